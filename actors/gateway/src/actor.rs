//! `GatewayActor`: owns the HTTP server, the frame inbox and their tasks.
//! Handlers run on the server's tasks (not through the mailbox); the actor's
//! mailbox carries lifecycle messages only.

use crate::config::GatewayConfig;
use crate::handlers::app;
use crate::inbox::Inbox;
use crate::metrics::Metrics;
use crate::models::ModelCache;
use crate::shared::Shared;
use dynamo_bus_schema::{unix_ms, GatewayId};
use dynamo_runtime::Bus;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

pub struct GatewayActor;

pub struct GatewayArgs {
    pub bus: Bus,
    pub config: GatewayConfig,
}

pub enum GatewayMsg {
    /// Stop accepting requests, let in-flight ones finish within the grace
    /// period, then reply.
    Shutdown(RpcReplyPort<()>),
}

pub struct GatewayRuntime {
    shared: Arc<Shared>,
    server_stop: CancellationToken,
    server: Option<JoinHandle<()>>,
    tasks: CancellationToken,
    _guard: DropGuard,
}

impl Actor for GatewayActor {
    type Msg = GatewayMsg;
    type State = GatewayRuntime;
    type Arguments = GatewayArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<GatewayMsg>,
        args: GatewayArgs,
    ) -> Result<GatewayRuntime, ActorProcessingErr> {
        let gateway_id = GatewayId::random();
        let frames_subject = args.bus.subjects.gateway_frames(gateway_id);
        let listener = tokio::net::TcpListener::bind(args.config.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", args.config.listen))?;
        let sub = args.bus.client.subscribe(frames_subject.clone()).await?;
        let shared = Arc::new(Shared {
            bus: args.bus,
            gateway_id,
            frames_subject,
            inbox: Inbox::default(),
            config: args.config.clone(),
            metrics: Metrics::new()?,
            models: ModelCache::default(),
            accepting: AtomicBool::new(true),
            started_unix_s: unix_ms() / 1000,
        });
        let tasks = CancellationToken::new();
        let guard = tasks.clone().drop_guard();
        let inbox_owner = shared.clone();
        let inbox_stop = tasks.child_token();
        tokio::spawn(async move { inbox_owner.inbox.run(sub, inbox_stop).await });

        let server_stop = tasks.child_token();
        let stop = server_stop.clone();
        let router = app(shared.clone());
        let server = tokio::spawn(async move {
            let res = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = res {
                tracing::error!(error = %e, "HTTP server failed");
            }
        });
        tracing::info!(listen = %args.config.listen, gateway = %gateway_id, "gateway serving");
        Ok(GatewayRuntime {
            shared,
            server_stop,
            server: Some(server),
            tasks,
            _guard: guard,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<GatewayMsg>,
        rt: &mut GatewayRuntime,
    ) -> Result<(), ActorProcessingErr> {
        rt.tasks.cancel();
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
                if let Some(server) = rt.server.take() {
                    let grace = rt.shared.config.shutdown_grace;
                    if tokio::time::timeout(grace, server).await.is_err() {
                        tracing::warn!(
                            ?grace,
                            "in-flight requests did not finish within the grace period"
                        );
                    }
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}
