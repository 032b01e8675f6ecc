//! An unbatched send-send cycle deadlocks under HCCL's rendezvous; the emulator reports
//! it after its timeout (own test binary: it shortens the timeout process-wide).
#![cfg(ascend_emulator)]

use ascend_sys::*;
use std::ptr::null_mut;

#[test]
fn send_send_cycle_times_out_with_a_report() {
    std::env::set_var("MPIPE_ASCEND_EMU_TIMEOUT_MS", "300");
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let root = &root;
    let results: Vec<(aclError, HcclResult)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|r| {
                s.spawn(move || unsafe {
                    let rc = aclInit(std::ptr::null());
                    assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
                    assert_eq!(aclrtSetDevice(r as i32), ACL_SUCCESS);
                    let mut st = null_mut();
                    assert_eq!(aclrtCreateStream(&mut st), ACL_SUCCESS);
                    let mut comm = null_mut();
                    assert_eq!(
                        HcclCommInitRootInfo(2, root, r, &mut comm),
                        HcclResult::HCCL_SUCCESS
                    );
                    let mut b = [1f32; 8];
                    let t = HcclDataType::HCCL_DATA_TYPE_FP32;
                    // Posting succeeds; the stream's execution is what deadlocks.
                    assert_eq!(
                        HcclSend(b.as_mut_ptr().cast(), 8, t, 1 - r, comm, st),
                        HcclResult::HCCL_SUCCESS
                    );
                    assert_eq!(
                        HcclRecv(b.as_mut_ptr().cast(), 8, t, 1 - r, comm, st),
                        HcclResult::HCCL_SUCCESS
                    );
                    let sync = aclrtSynchronizeStream(st);
                    let mut e = HcclResult::HCCL_SUCCESS;
                    assert_eq!(
                        HcclGetCommAsyncError(comm, &mut e),
                        HcclResult::HCCL_SUCCESS
                    );
                    (sync, e)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (sync, e) in results {
        assert_ne!(sync, ACL_SUCCESS);
        assert_eq!(e, HcclResult::HCCL_E_TIMEOUT);
    }
}
