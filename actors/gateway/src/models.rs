//! Per-model preprocessors, built from the model card a worker registered
//! and the tokenizer artifact fetched from that worker over the bus.
//!
//! Invariants: a preprocessor is kept per (model, card digest), at most
//! [`CARDS_PER_MODEL`] per model; requests of a model are tokenized with
//! its *current* card, which is the newest the router knew when the model
//! was first loaded and becomes whichever card a routed worker turned out
//! to have ([`ModelCache::get_card`]): after a rolling upgrade the first
//! request that reaches an upgraded worker switches the model over.

use crate::error::ApiError;
use crate::shared::Shared;
use dynamo_bus_schema::{ArtifactChunk, ArtifactRequest, ModelCard, WorkerId};
use dynamo_model::Preprocessor;
use dynamo_router::{ModelEntry, RouterMsg};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Cards (digests) of one model kept loaded at once (a mixed fleet in a
/// rolling upgrade has two).
pub const CARDS_PER_MODEL: usize = 4;

/// A model's preprocessor and the digest of the card it was built from.
#[derive(Clone)]
pub struct Loaded {
    pub pre: Arc<Preprocessor>,
    pub digest: u64,
}

struct Cards {
    current: u64,
    /// Newest last.
    loaded: Vec<Loaded>,
}

/// How long a (non-empty) listing of the served models answers for a name
/// it lacks: a flood of unknown names is refused from it, without a router
/// call each. A model that registers meanwhile is seen after at most this.
pub const LISTING_TTL: Duration = Duration::from_millis(500);

#[derive(Default)]
pub struct ModelCache {
    ready: RwLock<HashMap<String, Cards>>,
    loading: tokio::sync::Mutex<()>,
    /// The names in the last listing, and when it was taken.
    listed: RwLock<Option<(Instant, Vec<String>)>>,
}

/// The answer for a model no worker serves now: a model this gateway is
/// configured to serve has no worker yet (503, which a held request waits
/// out); any other does not exist here (404).
fn not_served(shared: &Shared, model: &str) -> ApiError {
    if shared.config.held_models.iter().any(|m| m == model) {
        ApiError::unavailable(format!("No worker of {model} is ready yet; retry shortly."))
    } else {
        ApiError::model_not_found(model)
    }
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
    fn lookup(&self, model: &str, digest: Option<u64>) -> Option<Loaded> {
        let r = self.ready.read().ok()?;
        let cards = r.get(model)?;
        let want = digest.unwrap_or(cards.current);
        cards.loaded.iter().find(|l| l.digest == want).cloned()
    }

    /// Whether a listing younger than [`LISTING_TTL`] lacks `model`.
    fn listed_without(&self, model: &str) -> bool {
        let Ok(l) = self.listed.read() else {
            return false;
        };
        match &*l {
            Some((at, names)) => at.elapsed() < LISTING_TTL && !names.iter().any(|n| n == model),
            None => false,
        }
    }

    fn keep(&self, model: &str, l: Loaded) {
        let Ok(mut r) = self.ready.write() else {
            return;
        };
        let cards = r.entry(model.to_string()).or_insert_with(|| Cards {
            current: l.digest,
            loaded: Vec::new(),
        });
        cards.current = l.digest;
        cards.loaded.retain(|x| x.digest != l.digest);
        cards.loaded.push(l);
        if cards.loaded.len() > CARDS_PER_MODEL {
            cards.loaded.remove(0);
        }
    }

    /// The preprocessor of `model`'s current card, loading it on first use.
    pub async fn get(&self, shared: &Shared, model: &str) -> Result<Loaded, ApiError> {
        if let Some(l) = self.lookup(model, None) {
            return Ok(l);
        }
        if self.listed_without(model) {
            return Err(not_served(shared, model));
        }
        let _one_at_a_time = self.loading.lock().await;
        if let Some(l) = self.lookup(model, None) {
            return Ok(l);
        }
        if self.listed_without(model) {
            return Err(not_served(shared, model));
        }
        let all = list(shared).await?;
        if all.is_empty() {
            return Err(ApiError::unavailable(
                "No workers are registered: no model can be served right now. Retry shortly.",
            ));
        }
        if let Ok(mut l) = self.listed.write() {
            let names = all.iter().map(|m| m.card.name.0.clone()).collect();
            *l = Some((Instant::now(), names));
        }
        let Some(entry) = all.into_iter().find(|m| m.card.name.0 == model) else {
            return Err(not_served(shared, model));
        };
        // The workers that have the newest card first.
        let workers = entry.workers.clone();
        self.load(shared, model, entry.card, &workers).await
    }

    /// The preprocessor of the card with `digest` (a routed worker's), which
    /// becomes the model's current card.
    pub async fn get_card(
        &self,
        shared: &Shared,
        model: &str,
        digest: u64,
    ) -> Result<Loaded, ApiError> {
        if let Some(l) = self.lookup(model, Some(digest)) {
            self.keep(model, l.clone());
            return Ok(l);
        }
        let _one_at_a_time = self.loading.lock().await;
        if let Some(l) = self.lookup(model, Some(digest)) {
            self.keep(model, l.clone());
            return Ok(l);
        }
        let workers = shared.workers().await?;
        let with: Vec<_> = workers
            .into_iter()
            .filter(|w| w.reg.model.name.0 == model && w.card_digest == digest)
            .collect();
        let Some(first) = with.first() else {
            return Err(ApiError::unavailable(
                "The model's workers changed while this request was routed; retry.",
            ));
        };
        let card = first.reg.model.clone();
        let ids: Vec<WorkerId> = with.iter().map(|w| w.reg.worker_id).collect();
        tracing::info!(
            model,
            digest = format!("{digest:016x}"),
            "a worker has another model card; switching to it"
        );
        self.load(shared, model, card, &ids).await
    }

    async fn load(
        &self,
        shared: &Shared,
        model: &str,
        card: ModelCard,
        workers: &[WorkerId],
    ) -> Result<Loaded, ApiError> {
        let mut last_err = None;
        for w in workers {
            match fetch_tokenizer(shared, *w, &card).await {
                Ok(bytes) => {
                    let card = card.clone();
                    let digest = card.digest();
                    let pre = tokio::task::spawn_blocking(move || Preprocessor::new(card, &bytes))
                        .await
                        .map_err(|e| ApiError::internal(format!("tokenizer load panicked: {e}")))?
                        .map_err(|e| {
                            ApiError::internal(format!("cannot load the tokenizer of {model}: {e}"))
                        })?;
                    let l = Loaded {
                        pre: Arc::new(pre),
                        digest,
                    };
                    self.keep(model, l.clone());
                    tracing::info!(model, worker = %w, "model preprocessor loaded");
                    return Ok(l);
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
            max_len: 256 * 1024,
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
    if dynamo_model::card::sha256_hex(&out) != card.tokenizer.sha256 {
        return Err("the tokenizer's digest does not match the card".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_listing_refuses_the_names_it_lacks_and_an_old_one_does_not() {
        let c = ModelCache::default();
        assert!(!c.listed_without("b"), "no listing yet: ask the router");
        *c.listed.write().unwrap() = Some((Instant::now(), vec!["a".into()]));
        assert!(c.listed_without("b"));
        assert!(!c.listed_without("a"));
        let old = Instant::now().checked_sub(LISTING_TTL * 2).unwrap();
        *c.listed.write().unwrap() = Some((old, vec!["a".into()]));
        assert!(!c.listed_without("b"), "stale: ask the router again");
    }
}
