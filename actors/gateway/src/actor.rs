//! `GatewayActor`: owns the HTTP server, the frame inbox and their tasks.
//! Handlers run on the server's tasks (not through the mailbox); the actor's
//! mailbox carries lifecycle messages only.
//!
//! Invariants: the server and the inbox are long-lived tasks of the
//! actor's `Tasks`: if either ends on its own (the listener fails, the
//! subscription closes) the actor fails and its supervisor restarts it
//! (a new server, a new inbox); every short-lived task (a stream, a
//! cancel) belongs to the same set and stops with it.

use crate::admission::Admission;
use crate::config::GatewayConfig;
use crate::handlers::app;
use crate::inbox::Inbox;
use crate::metrics::Metrics;
use crate::models::ModelCache;
use crate::preprocess::PreprocessPool;
use crate::shared::{Shared, CONTROL_CONCURRENCY};
use dynamo_bus_schema::{unix_ms, FaultKind, GatewayId};
use dynamo_runtime::{Bus, Gate, Tasks};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub struct GatewayActor;

pub struct GatewayArgs {
    pub bus: Bus,
    pub config: GatewayConfig,
}

/// How long streams still open when a shutdown's grace ends get to write
/// their last (error) event before the server closes their connections.
const STREAM_GOODBYE: std::time::Duration = std::time::Duration::from_millis(200);

pub enum GatewayMsg {
    /// Stop accepting requests, let in-flight ones finish within the grace
    /// period, then reply.
    Shutdown(RpcReplyPort<()>),
    /// A background task ended on its own.
    TaskEnded(String),
    /// Fault injection ([`FaultKind::EndTask`]: `server` or `inbox`).
    InjectFault(FaultKind, String),
}

pub struct GatewayRuntime {
    shared: Arc<Shared>,
    server_stop: CancellationToken,
    /// Fires when the server has finished (graceful shutdown done).
    server_done: Option<tokio::sync::oneshot::Receiver<()>>,
    tasks: Tasks,
}

impl Actor for GatewayActor {
    type Msg = GatewayMsg;
    type State = GatewayRuntime;
    type Arguments = GatewayArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<GatewayMsg>,
        args: GatewayArgs,
    ) -> Result<GatewayRuntime, ActorProcessingErr> {
        let me = myself.clone();
        let tasks = Tasks::new(Arc::new(move |why| {
            let _ = me.cast(GatewayMsg::TaskEnded(why));
        }));
        let gateway_id = GatewayId::random();
        let frames_subject = args.bus.subjects.gateway_frames(gateway_id);
        let listener = listen(args.config.listen)
            .map_err(|e| format!("cannot listen on {}: {e}", args.config.listen))?;
        let sub = args.bus.client.subscribe(frames_subject.clone()).await?;
        let c = &args.config;
        let shared = Arc::new(Shared {
            bus: args.bus.clone(),
            gateway_id,
            frames_subject,
            inbox: Inbox::default(),
            metrics: Metrics::new()?,
            models: ModelCache::default(),
            admission: Admission::new(c.admission.clone()),
            preprocess: PreprocessPool::new(c.preprocess_threads, c.blocking_preprocess_bytes),
            control: Gate::new(CONTROL_CONCURRENCY),
            spawner: tasks.spawner(),
            config: args.config.clone(),
            accepting: AtomicBool::new(true),
            grace_over: Default::default(),
            started_unix_s: unix_ms() / 1000,
            feed: crate::feed::Feed::default(),
            auth: crate::auth::Auth::new(c.api_keys.clone(), std::time::Instant::now()),
            events: crate::dashboard::Events::default(),
            room: crate::dispatch::Room::new(c.admission.max_queued as usize),
        });
        let inbox_owner = shared.clone();
        tasks.spawn("inbox", async move {
            let s = inbox_owner.clone();
            inbox_owner
                .inbox
                .run(sub, move |worker, id| {
                    tracing::debug!(request = %id, %worker, "a worker runs a request this gateway does not have: cancelling it");
                    s.metrics.orphan_cancels.inc();
                    crate::dispatch::send_cancel(&s, worker, id, dynamo_bus_schema::CancelReason::Orphaned)
                })
                .await
        });
        let feed_owner = shared.clone();
        tasks.spawn(
            "planner feed",
            async move { publish_feed(feed_owner).await },
        );

        let server_stop = CancellationToken::new();
        let (stop, asked) = (server_stop.clone(), server_stop.clone());
        // Connections are served by tasks of the server's own (`conn`):
        // they close (after their in-flight requests) when the server is
        // stopped or when this actor's tasks stop, so a restarted gateway
        // leaves none behind.
        let gone = tasks.token();
        let router = app(shared.clone());
        let limits = crate::conn::ConnLimits {
            max_connections: args.config.max_connections,
            client_timeout: args.config.client_timeout,
        };
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let shutdown = async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = gone.cancelled() => {}
            }
        };
        let server: std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<()>> + Send>,
        > = match &args.config.tls {
            Some(tls) => {
                // HTTPS: handshakes run in the accept loop's own tasks;
                // the loop is this actor's (it fails the gateway if it ends).
                let (listener, accept) =
                    crate::tls::TlsListener::new(listener, tls.config.clone())?;
                tasks.spawn("https accept", accept);
                Box::pin(async move {
                    crate::conn::serve(listener, router, limits, shutdown).await;
                    Ok(())
                })
            }
            None => {
                // Small writes (an SSE chunk per token, a 429) go out at
                // once: with Nagle's algorithm a write waits for the
                // client's delayed ACK.
                use axum::serve::ListenerExt;
                let listener = listener.tap_io(|tcp| {
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                    }
                });
                Box::pin(async move {
                    crate::conn::serve(listener, router, limits, shutdown).await;
                    Ok(())
                })
            }
        };
        tasks.spawn("server", async move {
            let res = server.await;
            if let Err(e) = &res {
                tracing::error!(error = %e, "HTTP server failed");
            }
            let _ = done_tx.send(());
            if asked.is_cancelled() && res.is_ok() {
                // Shut down on purpose: not an unexpected end.
                std::future::pending::<()>().await;
            }
        });
        tracing::info!(
            listen = %args.config.listen,
            https = args.config.tls.is_some(),
            gateway = %gateway_id,
            "gateway serving"
        );
        Ok(GatewayRuntime {
            shared,
            server_stop,
            server_done: Some(done_rx),
            tasks,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<GatewayMsg>,
        rt: &mut GatewayRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.shutdown();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<GatewayMsg>,
        msg: GatewayMsg,
        rt: &mut GatewayRuntime,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            GatewayMsg::Shutdown(reply) => {
                rt.shared.accepting.store(false, Ordering::Relaxed);
                rt.server_stop.cancel();
                if let Some(done) = rt.server_done.take() {
                    // Without the bus no request in flight can finish: no
                    // grace to wait out.
                    let grace = if rt.shared.bus.is_connected() {
                        rt.shared.config.shutdown_grace
                    } else {
                        std::time::Duration::ZERO
                    };
                    if tokio::time::timeout(grace, done).await.is_err() {
                        tracing::warn!(
                            ?grace,
                            "in-flight requests did not finish within the grace period"
                        );
                        // Open streams say why they end, then the server goes.
                        rt.shared.grace_over.cancel();
                        tokio::time::sleep(STREAM_GOODBYE).await;
                    }
                }
                let _ = reply.send(());
            }
            GatewayMsg::TaskEnded(why) => return Err(format!("gateway: {why}").into()),
            GatewayMsg::InjectFault(FaultKind::EndTask, task) => {
                if !rt.tasks.end(&task) {
                    tracing::warn!(task, tasks = ?rt.tasks.names(), "no such task to end");
                }
            }
            GatewayMsg::InjectFault(FaultKind::PanicActor, _) => {
                panic!("fault injected into the gateway")
            }
            GatewayMsg::InjectFault(other, _) => {
                tracing::warn!(?other, "fault not applicable to the gateway")
            }
        }
        Ok(())
    }
}

/// Connections the kernel queues for the accept loop. A burst of clients
/// (thousands connecting at once under overload) past the default (1,024)
/// would be dropped and retried by their TCP stacks a second later; the
/// kernel caps it at `net.core.somaxconn`.
const ACCEPT_BACKLOG: u32 = 8192;

/// The HTTP listener, with a deep accept queue.
fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// Publishes the traffic summaries every interval (a summary the bus does
/// not take within the interval is dropped: the next one follows).
async fn publish_feed(s: Arc<Shared>) {
    let every = s.config.metrics_interval;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tick.tick().await;
    let subject = s.bus.subjects.frontend_metrics();
    let gateway = format!("{}@{}", s.gateway_id, s.config.listen);
    loop {
        tick.tick().await;
        let inflight = s.metrics.inflight.get().max(0) as u32;
        let out = s.feed.take(
            &gateway,
            unix_ms(),
            every.as_millis() as u32,
            &|m| s.admission.waiting(m),
            inflight,
        );
        for m in out {
            match tokio::time::timeout(every, s.bus.publish(subject.clone(), &m)).await {
                Ok(Ok(())) => {}
                _ => tracing::debug!(model = %m.model, "planner feed not published"),
            }
        }
    }
}
