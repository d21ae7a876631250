//! Real libfabric endpoints on loopback: one-sided writes land byte for
//! byte, and a write to a peer that is gone fails within its timeout.

use dynamo_transfer::{
    Agent, Expecting, FabricError, Peer, Progress, Region, RemoteRegion, WriteOp,
};
use std::time::Duration;

fn write_and_check(provider: &str) {
    let mut target = Agent::new(provider).expect("provider available");
    let mut dst = target.register(1 << 20).unwrap();
    let remote = dst.remote();
    let addr = target.address().unwrap();
    // The target makes progress in its own thread while the writes run.
    let progress = Progress::spawn(target).unwrap();
    let mut init = Agent::new(provider).unwrap();
    let peer = init.insert_peer(&addr).unwrap();
    let mut src = init.register(1 << 20).unwrap();
    for (i, b) in src.bytes_mut().iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let op = |offset, len, remote_offset| WriteOp {
        local: &src,
        offset,
        len,
        peer,
        remote: &remote,
        remote_offset,
        notify: None,
    };
    init.write(op(4096, 65536, 8192), Duration::from_secs(10))
        .unwrap();
    init.write(
        WriteOp {
            local: &src,
            offset: 0,
            len: 100,
            peer,
            remote: &remote,
            remote_offset: 0,
            notify: None,
        },
        Duration::from_secs(10),
    )
    .unwrap();
    progress.stop().unwrap();
    let got = dst.bytes_mut();
    assert_eq!(&got[8192..8192 + 65536], &src.bytes()[4096..4096 + 65536]);
    assert_eq!(&got[..100], &src.bytes()[..100]);
    assert!(
        got[100..8192].iter().all(|b| *b == 0),
        "nothing else written"
    );
    // Out-of-range writes are refused before they reach the wire.
    assert!(matches!(
        init.write(op(0, 16, remote.len - 8), Duration::from_secs(1)),
        Err(FabricError::OutOfRange { .. })
    ));
}

#[test]
fn tcp_rxm_write_lands_byte_for_byte() {
    write_and_check("tcp;ofi_rxm");
}

#[test]
fn shm_write_lands_byte_for_byte() {
    write_and_check("shm");
}

/// Starts the target's progress thread (polling hard) and an initiator
/// that has the target as a peer.
fn connect(provider: &str, target: Agent) -> (Progress, Expecting, Agent, Peer) {
    let addr = target.address().unwrap();
    let progress = Progress::spawn(target).unwrap();
    let spin = progress.expect();
    let mut init = Agent::new(provider).unwrap();
    let peer = init.insert_peer(&addr).unwrap();
    (progress, spin, init, peer)
}

/// A write with a notice: the target learns from its own completion queue
/// that the data is in place; a read brings the bytes back.
fn notify_and_read(provider: &str) {
    let mut target = Agent::new(provider).expect("provider available");
    let mut dst = target.register(8192).unwrap();
    dst.bytes_mut()[4096..].fill(9);
    let remote = dst.remote();
    let (progress, _spin, mut init, peer) = connect(provider, target);
    let mut src = init.register(8192).unwrap();
    src.bytes_mut()[..4096].fill(5);
    let op = |notify| WriteOp {
        local: &src,
        offset: 0,
        len: 4096,
        peer,
        remote: &remote,
        remote_offset: 0,
        notify,
    };
    assert!(!progress.take_notice(77));
    init.write(op(Some(77)), Duration::from_secs(10)).unwrap();
    let t0 = std::time::Instant::now();
    while !progress.take_notice(77) {
        assert!(t0.elapsed() < Duration::from_secs(5), "notice never came");
        std::thread::yield_now();
    }
    assert!(!progress.take_notice(77), "a notice is taken once");
    let back = WriteOp {
        local: &src,
        offset: 4096,
        len: 4096,
        peer,
        remote: &remote,
        remote_offset: 4096,
        notify: None,
    };
    init.read(back, Duration::from_secs(10)).unwrap();
    assert!(src.bytes()[4096..].iter().all(|b| *b == 9));
    drop(progress);
    assert!(dst.bytes()[..4096].iter().all(|b| *b == 5));
}

#[test]
fn tcp_rxm_notices_and_reads() {
    notify_and_read("tcp;ofi_rxm");
}

#[test]
fn shm_notices_and_reads() {
    notify_and_read("shm");
}

/// A window takes writes while it lives; once closed, a late write through
/// its descriptor fails and the bytes stay as they were.
fn closed_windows_refuse_late_writes(provider: &str) {
    let mut target = Agent::new(provider).expect("provider available");
    let mut dst = target.register(8192).unwrap();
    // SAFETY: `dst` outlives the window (dropped below, before `dst`).
    let window = unsafe { target.window(&mut dst, 4096, 4096).unwrap() };
    let remote = window.remote();
    let (progress, _spin, mut init, peer) = connect(provider, target);
    let mut src = init.register(8192).unwrap();
    src.bytes_mut()[..4096].fill(3);
    src.bytes_mut()[4096..].fill(4);
    let op = |offset| WriteOp {
        local: &src,
        offset,
        len: 4096,
        peer,
        remote: &remote,
        remote_offset: 0,
        notify: None,
    };
    init.write(op(0), Duration::from_secs(10)).unwrap();
    drop(window);
    assert!(init.write(op(4096), Duration::from_secs(2)).is_err());
    drop(progress);
    assert!(
        dst.bytes()[..4096].iter().all(|b| *b == 0),
        "outside the window"
    );
    assert!(
        dst.bytes()[4096..].iter().all(|b| *b == 3),
        "the late write was refused"
    );
}

#[test]
fn tcp_rxm_closed_windows_refuse_late_writes() {
    closed_windows_refuse_late_writes("tcp;ofi_rxm");
}

#[test]
fn shm_closed_windows_refuse_late_writes() {
    closed_windows_refuse_late_writes("shm");
}

/// A frozen region is read by peers and refuses their writes, through its
/// new key and the key it had before.
fn frozen_regions_refuse_writes(provider: &str) {
    let mut target = Agent::new(provider).expect("provider available");
    let mut region = target.register(8192).unwrap();
    region.bytes_mut().fill(7);
    let before = region.remote();
    let frozen = target.freeze(region).unwrap();
    let remote = frozen.remote();
    assert_ne!(remote.key, before.key);
    let addr = target.address().unwrap();
    let (progress, _spin, mut init, peer) = connect(provider, target);
    let mut into = init.register(8192).unwrap();
    let read = WriteOp {
        local: &into,
        offset: 0,
        len: 8192,
        peer,
        remote: &remote,
        remote_offset: 0,
        notify: None,
    };
    init.read(read, Duration::from_secs(10)).unwrap();
    assert!(into.bytes_mut().iter().all(|b| *b == 7), "read whole");
    // Writes through either key are refused, each on a connection of its
    // own (a refused write may end its connection).
    for key in [&before, &remote] {
        let mut w = Agent::new(provider).unwrap();
        let peer = w.insert_peer(&addr).unwrap();
        let mut src = w.register(8192).unwrap();
        src.bytes_mut().fill(9);
        let op = WriteOp {
            local: &src,
            offset: 0,
            len: 4096,
            peer,
            remote: key,
            remote_offset: 0,
            notify: None,
        };
        assert!(w.write(op, Duration::from_secs(2)).is_err());
        // A write given up on may still touch `src`: it stays with `w`.
        w.bury(src);
    }
    drop(progress);
    assert!(frozen.bytes().iter().all(|b| *b == 7), "nothing written");
}

#[test]
fn tcp_rxm_frozen_regions_refuse_writes() {
    frozen_regions_refuse_writes("tcp;ofi_rxm");
}

#[test]
fn shm_frozen_regions_refuse_writes() {
    frozen_regions_refuse_writes("shm");
}

/// A window over memory the agent does not own (an engine's KV pool)
/// takes writes, with their notice, only while it lives.
fn foreign_memory_windows(provider: &str) {
    let mut pool = vec![0u8; 3 * 4096];
    let mut target = Agent::new(provider).expect("provider available");
    // SAFETY: `pool` outlives the window and is not touched while it lives.
    let window = unsafe { target.window_at(pool.as_mut_ptr().add(4096), 4096).unwrap() };
    let remote = window.remote();
    let (progress, _spin, mut init, peer) = connect(provider, target);
    let mut src = init.register(4096).unwrap();
    src.bytes_mut().fill(6);
    let op = |notify| WriteOp {
        local: &src,
        offset: 0,
        len: 4096,
        peer,
        remote: &remote,
        remote_offset: 0,
        notify,
    };
    init.write(op(Some(5)), Duration::from_secs(10)).unwrap();
    let t0 = std::time::Instant::now();
    while !progress.take_notice(5) {
        assert!(t0.elapsed() < Duration::from_secs(5), "notice never came");
        std::thread::yield_now();
    }
    drop(window);
    assert!(init.write(op(None), Duration::from_secs(2)).is_err());
    drop(progress);
    assert!(pool[..4096].iter().all(|b| *b == 0));
    assert!(pool[4096..8192].iter().all(|b| *b == 6));
    assert!(pool[8192..].iter().all(|b| *b == 0));
    // SAFETY: a null or empty span is refused before anything is registered.
    let mut a = Agent::new(provider).unwrap();
    assert!(unsafe { a.window_at(std::ptr::null_mut(), 4096) }.is_err());
    assert!(unsafe { a.window_at(pool.as_mut_ptr(), 0) }.is_err());
}

#[test]
fn tcp_rxm_foreign_memory_windows() {
    foreign_memory_windows("tcp;ofi_rxm");
}

#[test]
fn shm_foreign_memory_windows() {
    foreign_memory_windows("shm");
}

/// A write to a target that stops polling times out; the source region
/// its provider may still read is kept by the agent, not freed, and is
/// freed once the write completes after all. A later write is not
/// confused by that late completion.
fn a_stalled_write_keeps_its_region_until_it_lands(provider: &str) {
    const LEN: usize = 1 << 20;
    let mut target = Agent::new(provider).expect("provider available");
    let dst = target.register(LEN).unwrap();
    let remote = dst.remote();
    let (progress, _spin, mut init, peer) = connect(provider, target);
    let warm = init.register(4096).unwrap();
    fn op<'a>(local: &'a Region, len: usize, peer: Peer, remote: &'a RemoteRegion) -> WriteOp<'a> {
        WriteOp {
            local,
            offset: 0,
            len,
            peer,
            remote,
            remote_offset: 0,
            notify: None,
        }
    }
    // The connection is up (set-up needs the target's progress too).
    init.write(op(&warm, 4096, peer, &remote), Duration::from_secs(10))
        .unwrap();
    progress.pause();
    let mut src = init.register(LEN).unwrap();
    src.bytes_mut().fill(8);
    assert!(matches!(
        init.write(op(&src, LEN, peer, &remote), Duration::from_millis(300)),
        Err(FabricError::Timeout(_))
    ));
    // The write given up on counts against its own region only.
    assert_eq!(init.abandoned_on(&src), 1);
    assert_eq!(init.abandoned_on(&warm), 0);
    init.bury(src);
    assert_eq!(init.buried_bytes(), LEN);
    assert_eq!(init.abandoned_ops(), 1);
    progress.resume();
    let t0 = std::time::Instant::now();
    while init.buried_bytes() > 0 {
        init.progress().unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the stalled write never completed"
        );
        std::thread::yield_now();
    }
    assert_eq!(init.abandoned_ops(), 0);
    init.write(op(&warm, 4096, peer, &remote), Duration::from_secs(10))
        .unwrap();
    drop(progress);
    assert!(
        dst.bytes()[4096..].iter().all(|b| *b == 8),
        "the late write landed whole"
    );
    // Nothing to keep: a region no abandoned operation uses is freed at once.
    init.bury(warm);
    assert_eq!(init.buried_bytes(), 0);
}

#[test]
fn tcp_rxm_a_stalled_write_keeps_its_region_until_it_lands() {
    a_stalled_write_keeps_its_region_until_it_lands("tcp;ofi_rxm");
}

#[test]
fn shm_a_stalled_write_keeps_its_region_until_it_lands() {
    a_stalled_write_keeps_its_region_until_it_lands("shm");
}

#[test]
fn unknown_provider_is_a_clear_error() {
    assert!(matches!(
        Agent::new("no-such-provider"),
        Err(FabricError::NoProvider(_))
    ));
}

fn write_to_a_gone_peer_fails_in_time(provider: &str) {
    let (remote, addr) = {
        let mut target = Agent::new(provider).unwrap();
        let region = target.register(4096).unwrap();
        (region.remote(), target.address().unwrap())
        // The target and its region are dropped here: the peer is gone.
    };
    let mut init = Agent::new(provider).unwrap();
    let src = init.register(4096).unwrap();
    let t0 = std::time::Instant::now();
    let res = init.insert_peer(&addr).and_then(|peer| {
        init.write(
            WriteOp {
                local: &src,
                offset: 0,
                len: 4096,
                peer,
                remote: &remote,
                remote_offset: 0,
                notify: None,
            },
            Duration::from_secs(2),
        )
    });
    assert!(res.is_err(), "a write to a gone peer succeeded");
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn tcp_rxm_write_to_a_gone_peer_fails_in_time() {
    write_to_a_gone_peer_fails_in_time("tcp;ofi_rxm");
}

/// libfabric 1.17's shm provider crashes (SIGSEGV inside libfabric) when a
/// write targets a peer whose shared-memory region is gone, so the transfer
/// layer must learn of a dead same-host peer before writing to it (the
/// worker registry does); kept here to re-check on newer libfabric.
#[test]
#[ignore = "libfabric 1.17 shm segfaults on a gone peer"]
fn shm_write_to_a_gone_peer_fails_in_time() {
    write_to_a_gone_peer_fails_in_time("shm");
}

/// A read target's progress thread, which sees no completion for one-sided
/// reads of its memory, spins while a peer reads (the data moves inside its
/// polls), and goes back to idle polling once the reads stop; a write
/// target's thread (plain `spawn`) spins only when told to.
fn a_read_target_spins_while_read_then_idles(provider: &str) {
    const LEN: usize = 32 << 20;
    for read_target in [true, false] {
        let mut target = Agent::new(provider).expect("provider available");
        let mut src = target.register(LEN).unwrap();
        src.bytes_mut().fill(3);
        let remote = src.remote();
        let addr = target.address().unwrap();
        let progress = if read_target {
            Progress::spawn_read_target(target).unwrap()
        } else {
            Progress::spawn(target).unwrap()
        };
        let mut init = Agent::new(provider).unwrap();
        let peer = init.insert_peer(&addr).unwrap();
        let dst = init.register(LEN).unwrap();
        let cold = |what: &str| {
            let t0 = std::time::Instant::now();
            while progress.hot() {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "{provider}: the progress thread still spins {what}"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        cold("before any read");
        let before = progress.hot_spells();
        for _ in 0..4 {
            init.read(
                WriteOp {
                    local: &dst,
                    offset: 0,
                    len: LEN,
                    peer,
                    remote: &remote,
                    remote_offset: 0,
                    notify: None,
                },
                Duration::from_secs(30),
            )
            .unwrap();
        }
        assert!(dst.bytes().iter().all(|b| *b == 3));
        let spells = progress.hot_spells() - before;
        if read_target {
            assert!(
                spells > 0,
                "{provider}: the read target's thread never spun while a peer read"
            );
        } else {
            assert_eq!(spells, 0, "{provider}: a write target's thread spun untold");
        }
        cold("after the reads");
        drop(src);
    }
}

#[test]
fn tcp_rxm_a_read_target_spins_while_read_then_idles() {
    a_read_target_spins_while_read_then_idles("tcp;ofi_rxm");
}

#[test]
fn shm_a_read_target_spins_while_read_then_idles() {
    a_read_target_spins_while_read_then_idles("shm");
}
