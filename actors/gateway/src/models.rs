//! Per-model preprocessors, built from the model card a worker registered
//! and the tokenizer artifact fetched from that worker over the bus.

use crate::error::ApiError;
use crate::shared::Shared;
use dynamo_bus_schema::{ArtifactChunk, ArtifactRequest, ModelCard};
use dynamo_model::Preprocessor;
use dynamo_router::{ModelEntry, RouterMsg};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

#[derive(Default)]
pub struct ModelCache {
    ready: RwLock<HashMap<String, Arc<Preprocessor>>>,
    loading: tokio::sync::Mutex<()>,
}

/// Every model the router knows, with its workers.
pub async fn list(shared: &Shared) -> Result<Vec<ModelEntry>, ApiError> {
    let router = shared.router()?;
    match router
        .call(RouterMsg::Models, Some(Duration::from_secs(2)))
        .await
    {
        Ok(ractor::rpc::CallResult::Success(m)) => Ok(m),
        _ => Err(ApiError::unavailable(
            "The router did not answer; retry shortly.",
        )),
    }
}

impl ModelCache {
    /// The preprocessor for `model`, loading it on first use.
    pub async fn get(&self, shared: &Shared, model: &str) -> Result<Arc<Preprocessor>, ApiError> {
        if let Some(p) = self.ready.read().ok().and_then(|r| r.get(model).cloned()) {
            return Ok(p);
        }
        let _one_at_a_time = self.loading.lock().await;
        if let Some(p) = self.ready.read().ok().and_then(|r| r.get(model).cloned()) {
            return Ok(p);
        }
        let all = list(shared).await?;
        if all.is_empty() {
            return Err(ApiError::unavailable(
                "No workers are registered: no model can be served right now. Retry shortly.",
            ));
        }
        let entry = all
            .into_iter()
            .find(|m| m.card.name.0 == model)
            .ok_or_else(|| ApiError::model_not_found(model))?;
        let mut last_err = None;
        for w in &entry.workers {
            match fetch_tokenizer(shared, *w, &entry.card).await {
                Ok(bytes) => {
                    let card = entry.card.clone();
                    let pre = tokio::task::spawn_blocking(move || Preprocessor::new(card, &bytes))
                        .await
                        .map_err(|e| ApiError::internal(format!("tokenizer load panicked: {e}")))?
                        .map_err(|e| {
                            ApiError::internal(format!("cannot load the tokenizer of {model}: {e}"))
                        })?;
                    let pre = Arc::new(pre);
                    if let Ok(mut r) = self.ready.write() {
                        r.insert(model.to_string(), pre.clone());
                    }
                    tracing::info!(model, worker = %w, "model preprocessor loaded");
                    return Ok(pre);
                }
                Err(e) => {
                    tracing::warn!(model, worker = %w, error = %e, "tokenizer fetch failed");
                    last_err = Some(e);
                }
            }
        }
        Err(ApiError::unavailable(format!(
            "Cannot fetch the tokenizer of {model} from any worker: {}",
            last_err.unwrap_or_else(|| "no workers".into())
        )))
    }
}

async fn fetch_tokenizer(
    shared: &Shared,
    worker: dynamo_bus_schema::WorkerId,
    card: &ModelCard,
) -> Result<Vec<u8>, String> {
    let subject = shared.bus.subjects.worker_artifact(worker);
    let want = card.tokenizer.len;
    if want > 256 * 1024 * 1024 {
        return Err(format!("tokenizer of {want} bytes is implausible"));
    }
    let mut out = Vec::with_capacity(want as usize);
    while (out.len() as u64) < want {
        let req = ArtifactRequest {
            name: card.tokenizer.name.clone(),
            offset: out.len() as u64,
            max_len: 512 * 1024,
        };
        let chunk: ArtifactChunk = shared
            .bus
            .request(subject.clone(), &req, Duration::from_secs(5))
            .await
            .map_err(|e| e.to_string())?;
        if chunk.offset != out.len() as u64 || chunk.total_len != want || chunk.data.is_empty() {
            return Err("inconsistent artifact chunk".into());
        }
        out.extend_from_slice(&chunk.data);
    }
    Ok(out)
}
