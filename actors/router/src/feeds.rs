//! What feeds a router from the bus: the workers bucket (watched with
//! history), load reports, KV events, peers' load events and heartbeats,
//! the active-load snapshot of a peer at start-up, and the requests a
//! router answers (info, snapshots).
//!
//! Invariants: every feed is a long-lived task of the router's `Tasks`
//! (one that ends fails the router, which restarts with fresh feeds);
//! every message it casts carries a ticket of that feed's [`Gate`], so at
//! most [`FEED_BACKLOG`] of one feed wait in the mailbox, after which the
//! feed waits and the bus subscription buffers (and past its capacity
//! drops: load reports are repeated, KV event gaps are re-synced from a
//! dump, peers' entries expire with their heartbeats); an undecodable
//! message is rejected and counted, never fatal.

use crate::actor::RouterMsg;
use dynamo_bus_schema::{
    decode, decode_assembled, decode_payload, peek_kind, ActiveLoadEvent, ActiveLoadSnapshot,
    ActiveLoadSnapshotRequest, ErrorKind, RouterHeartbeat, RouterId, WireError, WireMessage,
    WorkerId, WorkerRegistration,
};
use dynamo_runtime::{counters, Backoff, Bus, Gate, Ticket};
use futures::StreamExt;
use ractor::{ActorRef, RpcReplyPort};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Messages of one feed that may wait in the router's mailbox at once.
pub const FEED_BACKLOG: usize = 4096;

/// Watches the workers bucket (history first, then changes), re-watching
/// with backoff when the bus drops; says when the history has been read.
pub async fn watch_workers(bus: Bus, router: ActorRef<RouterMsg>, gate: Gate) {
    let bucket = bus.subjects.workers_bucket();
    let mut backoff = Backoff::new(
        Duration::from_millis(100),
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    loop {
        let watch = async {
            let kv = bus
                .kv_bucket(&bucket, dynamo_runtime::bus::REGISTRY_MAX_AGE)
                .await?;
            kv.watch_with_history(">")
                .await
                .map_err(|e| dynamo_runtime::BusError::Bucket {
                    bucket: bucket.clone(),
                    reason: e.to_string(),
                })
        };
        let mut w = match watch.await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch worker registrations; retrying");
                tokio::time::sleep(backoff.next_delay(Instant::now())).await;
                continue;
            }
        };
        // The history is read once an entry says nothing is pending, or
        // when none comes at all (an empty bucket).
        let mut history_read = false;
        let quiet = tokio::time::sleep(Duration::from_millis(200));
        tokio::pin!(quiet);
        loop {
            let entry = tokio::select! {
                _ = &mut quiet, if !history_read => {
                    history_read = true;
                    let _ = router.cast(RouterMsg::RegistryLoaded);
                    continue;
                }
                e = w.next() => e,
            };
            // Signalled after this entry's own message (below).
            let last_of_history = matches!(&entry, Some(Ok(e)) if e.delta == 0) && !history_read;
            let entry = match entry {
                Some(Ok(e)) => e,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "worker watch failed; re-watching");
                    break;
                }
                None => break,
            };
            let ticket = gate.enter().await;
            let msg = match entry.operation {
                async_nats::jetstream::kv::Operation::Put => {
                    match decode::<WorkerRegistration>(&entry.value) {
                        Ok(reg) => RouterMsg::Upsert(Box::new(reg), ticket),
                        Err(e) => {
                            counters::reject("WorkerRegistration", &entry.key, &e);
                            continue;
                        }
                    }
                }
                _ => match entry.key.parse::<WorkerId>() {
                    Ok(id) => RouterMsg::Remove(id, ticket),
                    Err(e) => {
                        counters::reject("worker key", &entry.key, &e);
                        continue;
                    }
                },
            };
            if router.cast(msg).is_err() {
                return;
            }
            if last_of_history {
                history_read = true;
                let _ = router.cast(RouterMsg::RegistryLoaded);
            }
        }
        tokio::time::sleep(backoff.next_delay(Instant::now())).await;
    }
}

/// Forwards every decodable `T` published on `subject` to the router as
/// `wrap(T, ticket)`; undecodable messages are rejected and counted.
pub async fn forward<T: WireMessage>(
    bus: Bus,
    subject: String,
    router: ActorRef<RouterMsg>,
    gate: Gate,
    wrap: fn(T, Ticket) -> RouterMsg,
) {
    let sub = match bus.client.subscribe(subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(subject, error = %e, "cannot subscribe");
            return;
        }
    };
    forward_from(sub, router, gate, wrap).await
}

/// [`forward`] from a subscription already made, to any actor (the router
/// or its indexer).
pub async fn forward_from<T: WireMessage, M: ractor::Message>(
    mut sub: async_nats::Subscriber,
    actor: ActorRef<M>,
    gate: Gate,
    wrap: fn(T, Ticket) -> M,
) {
    while let Some(msg) = sub.next().await {
        match decode::<T>(&msg.payload) {
            Ok(v) => {
                let ticket = gate.enter().await;
                if actor.cast(wrap(v, ticket)).is_err() {
                    return;
                }
            }
            Err(e) => counters::reject(T::NAME, msg.subject.as_str(), &e),
        }
    }
}

/// Follows the other replicas' load events and heartbeats (our own echo
/// is skipped: the state already has it).
pub async fn peer_load(
    mut sub: async_nats::Subscriber,
    me: RouterId,
    router: ActorRef<RouterMsg>,
    gate: Gate,
) {
    while let Some(m) = sub.next().await {
        let msg = match peek_kind(&m.payload) {
            Ok((k, p)) if k == ActiveLoadEvent::KIND => {
                match decode_payload::<ActiveLoadEvent>(p) {
                    Ok(ev) if ev.router_id == me => continue,
                    Ok(ev) => Ok(RouterMsg::RemoteLoad(ev, gate.enter().await)),
                    Err(e) => Err(e),
                }
            }
            Ok((k, p)) if k == RouterHeartbeat::KIND => {
                match decode_payload::<RouterHeartbeat>(p) {
                    Ok(h) => Ok(RouterMsg::PeerHeartbeat(h.router_id, gate.enter().await)),
                    Err(e) => Err(e),
                }
            }
            Ok((k, _)) => {
                counters::reject(
                    "router load",
                    m.subject.as_str(),
                    &format!("unknown kind {}", k.0),
                );
                continue;
            }
            Err(e) => Err(e),
        };
        match msg {
            Ok(msg) => {
                if router.cast(msg).is_err() {
                    return;
                }
            }
            Err(e) => counters::reject("router load", m.subject.as_str(), &e),
        }
    }
}

/// Asks a peer for its active-load snapshot (once the load subscription is
/// up, so nothing between the two is lost), then serves snapshots to
/// replicas that start after this one.
pub async fn snapshots(
    bus: Bus,
    me: RouterId,
    router: ActorRef<RouterMsg>,
    cancel: CancellationToken,
) {
    let req = ActiveLoadSnapshotRequest { router_id: me };
    // No responder: this is the first replica. A peer that is slow to
    // answer (a loaded machine) is asked again: without its snapshot this
    // replica would not see the requests already in flight.
    for attempt in 1..=3 {
        let answer = bus
            .request_large(bus.subjects.router_snapshot(), &req, Duration::from_secs(2))
            .await
            .and_then(|b| {
                decode_assembled::<ActiveLoadSnapshot>(&b).map_err(|source| {
                    dynamo_runtime::BusError::Decode {
                        subject: bus.subjects.router_snapshot(),
                        cause: source,
                    }
                })
            });
        match answer {
            Ok(snap) => {
                let _ = router.cast(RouterMsg::LoadSnapshot(snap.entries));
                break;
            }
            Err(e @ dynamo_runtime::BusError::NoResponders { .. }) => {
                tracing::info!(reason = %e, "no peer snapshot of the active load (first replica?)");
                break;
            }
            Err(e) => {
                tracing::warn!(reason = %e, attempt, "peer snapshot of the active load failed")
            }
        }
    }
    let _ = router.cast(RouterMsg::SnapshotDone);
    let sub = match bus
        .client
        .queue_subscribe(bus.subjects.router_snapshot(), "routers".into())
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve load snapshots");
            return;
        }
    };
    bus.serve(sub, cancel, |_: ActiveLoadSnapshotRequest| async {
        ask(&router, RouterMsg::ServeSnapshot)
            .await
            .map(|entries| ActiveLoadSnapshot { entries })
    })
    .await;
}

/// Answers `dynamoctl`'s info requests (one replica of the queue group answers).
pub async fn serve_info(bus: Bus, router: ActorRef<RouterMsg>, cancel: CancellationToken) {
    let sub = match bus
        .client
        .queue_subscribe(bus.subjects.router_info(), "routers".into())
        .await
    {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve router info");
            return;
        }
    };
    bus.serve(sub, cancel, |_: dynamo_bus_schema::RouterInfoRequest| {
        ask(&router, RouterMsg::Info)
    })
    .await;
}

/// Asks the router actor for something on behalf of a bus request.
async fn ask<T: Send + 'static>(
    router: &ActorRef<RouterMsg>,
    msg: fn(RpcReplyPort<T>) -> RouterMsg,
) -> Result<T, WireError> {
    match router.call(msg, Some(Duration::from_secs(2))).await {
        Ok(ractor::rpc::CallResult::Success(v)) => Ok(v),
        _ => Err(WireError::new(
            ErrorKind::Unavailable,
            "router is restarting",
        )),
    }
}

/// Casts `msg()` to the router or its indexer every `period` while no
/// earlier tick waits in the mailbox (a slow actor skips ticks instead of
/// piling them up).
pub async fn ticker<M: ractor::Message>(
    period: Duration,
    actor: ActorRef<M>,
    msg: fn(Ticket) -> M,
) {
    let gate = Gate::new(1);
    let mut iv = tokio::time::interval(period);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        iv.tick().await;
        if let Some(t) = gate.try_enter() {
            if actor.cast(msg(t)).is_err() {
                return;
            }
        }
    }
}
