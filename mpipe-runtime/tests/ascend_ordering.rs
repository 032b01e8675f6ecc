//! Mutation test of the Ascend backend's stream ordering on the emulator, whose
//! happens-before check sees every device-buffer access: the backend's steps are
//! free of hazards, and leaving out any single event wait it issues makes the
//! emulator report one, naming the HCCL call that read too early.
//!
//! One test in its own binary: the emulator's counters and hazard reports are per
//! device and process-wide, so no other test may use the devices meanwhile.
//!
//! `cargo test --release --features ascend -p mpipe-runtime --test ascend_ordering`
#![cfg(feature = "ascend")]

use mpipe_runtime::ascend::{counters, run_ranks, AscendComm, AscendError};
use mpipe_runtime::comm::{Comm, Tag};

const RANKS: usize = 3;
const ROUNDS: u32 = 4;

/// A ring exchange of `ROUNDS` batches per rank (each batch sends to the next rank
/// and receives from the previous one), rank 0 leaving out its `skip`-th event
/// wait. Returns rank 0's event waits, whether every rank received what was sent
/// (a missing wait may let a transfer read its buffer before the copy lands), and the
/// hazards reported on rank 0's device.
fn ring(skip: Option<u64>) -> (u64, bool, Vec<String>) {
    for d in 0..RANKS as i32 {
        counters::reset(d);
    }
    let out = run_ranks(
        RANKS,
        |mut c: AscendComm| -> Result<(u64, bool), AscendError> {
            let r = c.rank();
            if r == 0 {
                if let Some(k) = skip {
                    c.mutate_skip_event_wait(k);
                }
            }
            let (next, prev) = ((r + 1) % RANKS, (r + RANKS - 1) % RANKS);
            let mut right = true;
            for mb in 0..ROUNDS {
                let mine = vec![r as f32 + mb as f32; 1024];
                let got = c.batch(
                    &[(next, Tag::act(0, mb), &mine)],
                    &[(prev, Tag::act(0, mb), 1024)],
                )?;
                right &= got[0] == vec![prev as f32 + mb as f32; 1024];
            }
            Ok((c.event_waits(), right))
        },
    );
    let mut right = true;
    let mut waits = 0;
    for (r, o) in out.into_iter().enumerate() {
        let (w, ok) = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        right &= ok;
        if r == 0 {
            waits = w;
        }
    }
    (waits, right, ascend_sys_hazards(0))
}

fn ascend_sys_hazards(device: i32) -> Vec<String> {
    let n = counters::snapshot(device).map_or(0, |c| c.hazards);
    let reports = counters::hazard_reports(device);
    assert_eq!(reports.len() as u64, n, "every counted hazard is reported");
    reports
}

#[test]
fn every_event_wait_is_needed_and_none_is_missing() {
    let (waits, right, hazards) = ring(None);
    assert!(right, "every rank receives what its peer sent");
    assert!(hazards.is_empty(), "{hazards:#?}");
    assert_eq!(waits, u64::from(ROUNDS), "one wait per batch that sends");
    for k in 0..waits {
        // Whether the data then arrives intact depends on timing; the check does not.
        let (_, _, hazards) = ring(Some(k));
        assert!(
            !hazards.is_empty(),
            "leaving out event wait {k} went unnoticed"
        );
        assert!(
            hazards
                .iter()
                .any(|h| h.contains("HcclBatchSendRecv") && h.contains("aclrtMemcpyAsync")),
            "wait {k}: {hazards:#?}"
        );
    }
}
