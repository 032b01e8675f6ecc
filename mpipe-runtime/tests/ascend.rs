//! The Ascend backend over ascend-sys (the host emulator here: ranks are threads):
//! point-to-point of static sizes, each batch one `HcclBatchSendRecv`, collectives
//! over the world and over sub-groups, start-up over the TCP store, failures, and
//! ACL/HCCL codes mapped to typed errors.
//!
//! `cargo test --release --features ascend -p mpipe-runtime --test ascend`
#![cfg(feature = "ascend")]

use mpipe_runtime::ascend::safe::{self, DataType, DeviceBuffer, HcclComm, RootInfo, Stream};
use mpipe_runtime::ascend::{run_ranks, AscendComm, AscendError};
use mpipe_runtime::comm::{Comm, Tag};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Every test of this binary runs with a short HCCL timeout (the emulator's).
fn setup() {
    std::env::set_var("MPIPE_ASCEND_EMU_TIMEOUT_MS", "3000");
}

fn ok<T: std::fmt::Debug>(out: Vec<Result<T, String>>) -> Vec<T> {
    out.into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

#[test]
fn point_to_point_in_order_of_stated_lengths() {
    setup();
    let out = run_ranks(2, |mut c| -> Result<Vec<Vec<f32>>, AscendError> {
        let t = Tag::act(3, 0);
        if c.rank() == 0 {
            c.send(1, t, &[1.0, 2.0, 3.0])?;
            c.send(1, t, &[])?;
            c.send(1, t, &vec![0.5; 100_000])?;
            Ok(vec![])
        } else {
            Ok(vec![
                c.recv(0, t, 3)?,
                c.recv(0, t, 0)?,
                c.recv(0, t, 100_000)?,
            ])
        }
    });
    let got = ok(out);
    assert_eq!(got[1][0], vec![1.0, 2.0, 3.0]);
    assert!(got[1][1].is_empty());
    assert_eq!(got[1][2], vec![0.5; 100_000]);
}

#[test]
fn batches_cross_ring_and_self() {
    setup();
    let n = 4;
    let out = run_ranks(n, |mut c| -> Result<Vec<Vec<f32>>, AscendError> {
        let r = c.rank();
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let a = vec![r as f32; r + 1];
        let b = vec![10.0 + r as f32; 2];
        let me = vec![-1.0];
        // Both directions around the ring and one transfer to itself, one batch.
        c.batch(
            &[
                (next, Tag::act(0, 0), &a),
                (prev, Tag::grad(2, 0), &b),
                (r, Tag::input(0, 0), &me),
            ],
            &[
                (r, Tag::input(0, 0), 1),
                (prev, Tag::act(0, 0), prev + 1),
                (next, Tag::grad(2, 0), 2),
            ],
        )
    });
    for (r, got) in ok(out).into_iter().enumerate() {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        assert_eq!(got[0], vec![-1.0]);
        assert_eq!(got[1], vec![prev as f32; prev + 1]);
        assert_eq!(got[2], vec![10.0 + next as f32; 2]);
    }
}

/// HCCL allows one send to and one receive from each peer per `HcclBatchSendRecv`
/// (the program format's rule 3); a batch with two is refused before anything is
/// posted, naming the rule.
#[test]
fn two_sends_to_one_peer_in_a_batch_are_refused() {
    setup();
    let out = run_ranks(2, |mut c| -> Result<(), AscendError> {
        if c.rank() == 0 {
            c.batch(
                &[(1, Tag::act(0, 0), &[1.0]), (1, Tag::grad(1, 0), &[2.0])],
                &[],
            )?;
        }
        Ok(())
    });
    let e = out[0].as_ref().unwrap_err();
    assert!(e.contains("two sends to rank 1"), "{e}");
}

/// A transfer waits only for its own peer: rank 0's batch holds a send to 1 and a
/// receive from 2, and rank 2 sends only after hearing from rank 1, which receives
/// from 0 first. A scheme that waited for every length of a batch before posting
/// its data would deadlock here; rendezvous semantics do not.
#[test]
fn a_transfer_waits_only_for_its_peer() {
    setup();
    let out = run_ranks(3, |mut c| -> Result<f32, AscendError> {
        match c.rank() {
            0 => {
                let got = c.batch(&[(1, Tag::act(0, 0), &[1.0])], &[(2, Tag::act(2, 0), 1)])?;
                Ok(got[0][0])
            }
            1 => {
                let x = c.recv(0, Tag::act(0, 0), 1)?;
                c.send(2, Tag::act(1, 0), &[x[0] + 1.0])?;
                Ok(0.0)
            }
            _ => {
                let z = c.recv(1, Tag::act(1, 0), 1)?;
                c.send(0, Tag::act(2, 0), &[z[0] + 1.0])?;
                Ok(0.0)
            }
        }
    });
    assert_eq!(ok(out)[0], 3.0);
}

/// A batch's receives are all posted together: rank 0's batch receives from 1 and
/// from 2, and rank 1 sends only after hearing from 2, which sends to 0 first. A
/// batch that took its receives one after the other, in its own order, would wait
/// for 1 while 2 waits for 0.
#[test]
fn a_batch_takes_its_receives_in_any_order() {
    setup();
    let out = run_ranks(3, |mut c| -> Result<Vec<Vec<f32>>, AscendError> {
        match c.rank() {
            0 => c.batch(&[], &[(1, Tag::act(1, 0), 1), (2, Tag::act(2, 0), 1)]),
            1 => {
                let z = c.recv(2, Tag::act(2, 1), 1)?;
                c.send(0, Tag::act(1, 0), &[z[0] + 1.0])?;
                Ok(vec![])
            }
            _ => {
                c.send(0, Tag::act(2, 0), &[5.0])?;
                c.send(1, Tag::act(2, 1), &[7.0])?;
                Ok(vec![])
            }
        }
    });
    assert_eq!(ok(out)[0], vec![vec![8.0], vec![5.0]]);
}

#[test]
fn collectives_over_world_and_groups() {
    setup();
    let out = run_ranks(4, |mut c| -> Result<Vec<Vec<f32>>, AscendError> {
        let r = c.rank();
        let mut res = Vec::new();
        // World broadcast from rank 2.
        let mut b = if r == 2 { vec![7.0, 8.0] } else { vec![0.0; 2] };
        c.broadcast(2, &[0, 1, 2, 3], Tag::params(0), &mut b)?;
        res.push(b);
        // Broadcast over a sub-group (a sub-communicator), twice (cached).
        for k in 0..2 {
            if r >= 1 {
                let mut b = if r == 3 {
                    vec![k as f32; 3]
                } else {
                    vec![-1.0; 3]
                };
                c.broadcast(3, &[1, 2, 3], Tag::params(1), &mut b)?;
                res.push(b);
            }
        }
        // Reduce over {0, 2} onto 2.
        if r % 2 == 0 {
            let mut g = vec![r as f32 + 1.0; 4];
            c.reduce(2, &[0, 2], Tag::grads(1), &mut g)?;
            res.push(g);
        }
        // All-reduce over the world, then a barrier.
        let mut a = vec![r as f32, 1.0];
        c.all_reduce(&[0, 1, 2, 3], Tag::new(9, 0, 0), &mut a)?;
        res.push(a);
        c.barrier()?;
        Ok(res)
    });
    let got = ok(out);
    for (r, res) in got.iter().enumerate() {
        assert_eq!(res[0], vec![7.0, 8.0], "rank {r}");
        assert_eq!(res.last().unwrap(), &vec![6.0, 4.0], "rank {r}");
        if r >= 1 {
            assert_eq!(res[1], vec![0.0; 3]);
            assert_eq!(res[2], vec![1.0; 3]);
        }
    }
    // Rank 2 holds 1 + 3 = 4 after the reduce.
    assert_eq!(got[2][3], vec![4.0; 4]);
}

/// Sizes are static: a receiver that expects another count than its sender sends
/// gets HCCL's parameter error instead of a truncated or padded tensor.
#[test]
fn a_size_mismatch_is_a_parameter_error() {
    setup();
    let out = run_ranks(2, |mut c| -> Result<(), AscendError> {
        if c.rank() == 0 {
            c.send(1, Tag::act(0, 0), &[1.0, 2.0])?;
        } else {
            c.recv(0, Tag::act(0, 0), 3)?;
        }
        Ok(())
    });
    let e = out[1].as_ref().unwrap_err();
    assert!(e.contains("HCCL_E_PARA"), "{e}");
}

#[test]
fn separate_crossing_sends_deadlock_and_time_out() {
    setup();
    let t0 = Instant::now();
    let out = run_ranks(2, |mut c| -> Result<(), AscendError> {
        let peer = 1 - c.rank();
        c.send(peer, Tag::act(0, 0), &[1.0])?;
        c.recv(peer, Tag::act(0, 0), 1)?;
        Ok(())
    });
    for o in &out {
        let e = o.as_ref().unwrap_err();
        // The first rank to fail is reported by its own error (HCCL_E_TIMEOUT); the
        // other may instead see it as a failed peer.
        assert!(e.contains("HCCL_E_TIMEOUT") || e.contains("failed"), "{e}");
    }
    assert!(out
        .iter()
        .any(|o| o.as_ref().unwrap_err().contains("HCCL_E_TIMEOUT")));
    assert!(t0.elapsed() < Duration::from_secs(30));
}

#[test]
fn abort_fails_later_calls_on_every_rank() {
    setup();
    let gate = Barrier::new(2);
    let out = run_ranks(2, |mut c| -> Result<(), AscendError> {
        if c.rank() == 0 {
            c.abort("action 3 `F(llm.0,0)`");
            let again = c.barrier().unwrap_err();
            assert!(matches!(again, AscendError::PeerFailed { rank: 0, .. }));
            gate.wait();
            Ok(())
        } else {
            gate.wait();
            c.send(0, Tag::act(0, 0), &[1.0])
        }
    });
    assert!(out[0].is_ok());
    let e = out[1].as_ref().unwrap_err();
    assert!(e.contains("rank 0 failed: action 3"), "{e}");
}

#[test]
fn invalid_calls() {
    setup();
    let out = run_ranks(2, |mut c| -> Result<(), AscendError> {
        let bad = c.send(5, Tag::act(0, 0), &[1.0]).unwrap_err();
        assert!(matches!(bad, AscendError::Invalid(_)), "{bad}");
        let bad = c
            .broadcast(0, &[1, 0], Tag::params(0), &mut [0.0])
            .unwrap_err();
        assert!(bad.to_string().contains("not sorted"), "{bad}");
        let bad = c.recv(c.rank(), Tag::act(0, 0), 1).unwrap_err();
        assert!(bad.to_string().contains("same batch"), "{bad}");
        Ok(())
    });
    ok(out);
}

#[test]
fn codes_become_typed_errors() {
    setup();
    // An AscendCL code.
    let e = safe::Device::set(100_000).unwrap_err();
    assert_eq!(e.code_name(), Some("ACL_ERROR_RT_INVALID_DEVICEID"));
    assert!(matches!(
        e,
        AscendError::Acl {
            call: "aclrtSetDevice",
            code: 107001,
            ..
        }
    ));
    assert_eq!(
        e.to_string(),
        "aclrtSetDevice failed: ACL_ERROR_RT_INVALID_DEVICEID (107001)"
    );
    // HCCL codes: sending to oneself, and a null stream.
    std::thread::spawn(|| {
        let _d = safe::Device::set(0).unwrap();
        let info = RootInfo::new().unwrap();
        let comm = HcclComm::init(1, &info, 0).unwrap();
        let s = Stream::new().unwrap();
        let buf = DeviceBuffer::new(16).unwrap();
        let e = comm.send(&buf, 4, DataType::F32, 0, &s).unwrap_err();
        assert_eq!(e.hccl_code(), Some(1));
        assert_eq!(e.code_name(), Some("HCCL_E_PARA"));
        assert!(
            e.to_string()
                .starts_with("HcclSend failed: HCCL_E_PARA (1: "),
            "{e}"
        );
        let e = safe::hccl("HcclBarrier", ascend_sys::HcclResult::HCCL_E_PTR).unwrap_err();
        assert_eq!(e.code_name(), Some("HCCL_E_PTR"));
        assert_eq!(
            safe::hccl_error_name(ascend_sys::HcclResult(999)),
            "HCCL_E_UNKNOWN"
        );
    })
    .join()
    .unwrap();
}

#[test]
fn start_up_over_the_tcp_store() {
    setup();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let got: Vec<f32> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let mut c =
                        AscendComm::connect(r, 3, r as i32, master, Duration::from_secs(10))
                            .unwrap();
                    let mut v = vec![r as f32 + 1.0];
                    c.all_reduce(&[0, 1, 2], Tag::new(9, 0, 0), &mut v).unwrap();
                    v[0]
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, vec![6.0; 3]);
}

#[test]
fn world_needs_devices() {
    setup();
    let e = AscendComm::world_in_process(10_000).unwrap_err();
    assert!(matches!(e, AscendError::Setup(_)), "{e}");
}

/// With a rendezvous secret, rank 0's root-info store hands the root info only to
/// connections that prove it: a stranger that sends another secret, or nothing, is
/// dropped, gets no root info, and the real ranks still form their world.
#[test]
fn the_root_info_store_serves_only_the_jobs_ranks() {
    use std::io::{Read, Write};
    setup();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let secret = [7u8; 32];
    let got: Vec<f32> = std::thread::scope(|s| {
        let root = s.spawn(move || {
            let mut c =
                AscendComm::connect_with_secret(0, 2, 0, master, Duration::from_secs(20), &secret)
                    .unwrap();
            let mut v = vec![1.0];
            c.all_reduce(&[0, 1], Tag::new(9, 0, 0), &mut v).unwrap();
            v[0]
        });
        // Strangers first: a wrong secret, then an idle connection.
        let forged = loop {
            if let Ok(mut t) = std::net::TcpStream::connect(master) {
                t.write_all(&[9u8; 32]).unwrap();
                t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut buf = Vec::new();
                let _ = t.read_to_end(&mut buf);
                break buf;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            forged.is_empty(),
            "a wrong secret got {} bytes",
            forged.len()
        );
        let idle = std::net::TcpStream::connect(master).unwrap();
        let peer = s.spawn(move || {
            let mut c =
                AscendComm::connect_with_secret(1, 2, 1, master, Duration::from_secs(20), &secret)
                    .unwrap();
            let mut v = vec![2.0];
            c.all_reduce(&[0, 1], Tag::new(9, 0, 0), &mut v).unwrap();
            v[0]
        });
        let out = vec![root.join().unwrap(), peer.join().unwrap()];
        drop(idle);
        out
    });
    assert_eq!(got, vec![3.0; 2]);
}
