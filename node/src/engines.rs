//! The engine a worker group runs, as the factory a worker actor starts
//! (and restarts) its engine with.

use crate::config::{EngineSpec, WorkerGroup};
use crate::supervisor::GroupModel;
use dynamo_bus_schema::WorkerId;
use dynamo_cpu_engine::{CpuEngine, CpuModelInfo};
use dynamo_engine::Engine;
use dynamo_external_engine::engine::{ExternalEngine, ExternalModel};
use dynamo_mocker::{MockerEngine, MockerModel};
use dynamo_worker::EngineFactory;
use std::sync::Arc;

/// The factory of `grp`'s engine for worker `worker_id`.
pub fn factory(
    grp: &WorkerGroup,
    model: &GroupModel,
    worker_id: &WorkerId,
) -> Result<EngineFactory, String> {
    Ok(match (&grp.engine, &model.weights) {
        (EngineSpec::Mocker(cfg), _) => {
            let cfg = cfg.clone();
            let mocker_model = MockerModel {
                vocab_size: model.loaded.card.vocab_size,
                eos_token_ids: model.loaded.card.eos_token_ids.clone(),
                hash_salt: model.loaded.card.hash_salt,
            };
            Arc::new(move || {
                MockerEngine::start(cfg.clone(), mocker_model.clone())
                    .map(|e| Arc::new(e) as Arc<dyn Engine>)
                    .map_err(|e| e.to_string())
            })
        }
        (EngineSpec::Cpu { config, block_size }, Some(weights)) => {
            let (cfg, weights) = (config.clone(), weights.clone());
            let info = CpuModelInfo {
                block_size: *block_size,
                hash_salt: model.loaded.card.hash_salt,
                eos_token_ids: model.loaded.card.eos_token_ids.clone(),
            };
            Arc::new(move || {
                CpuEngine::start(cfg.clone(), weights.clone(), info.clone())
                    .map(|e| Arc::new(e) as Arc<dyn Engine>)
                    .map_err(|e| e.to_string())
            })
        }
        (EngineSpec::Cpu { .. }, None) => return Err("cpu engine without loaded weights".into()),
        (EngineSpec::External { config, .. }, _) => {
            let cfg = (**config).clone();
            let tok = dynamo_model::Tokenizer::from_json(&model.loaded.tokenizer_json)
                .map_err(|e| format!("tokenizer: {e}"))?;
            let tok = Arc::new(tok);
            let t = tok.clone();
            let retokenize: dynamo_external_engine::engine::Retokenize =
                Arc::new(move |text: &str| t.encode(text).ok());
            let detokenize: dynamo_external_engine::engine::Detokenize =
                Arc::new(move |ids: &[u32]| tok.decode_with_special(ids).ok());
            let info = ExternalModel {
                name: model.loaded.card.name.0.clone(),
                vocab_size: model.loaded.card.vocab_size,
                block_size: model.loaded.card.block_size as usize,
                model_path: Some(model.loaded.path.clone()),
                worker: worker_id.to_string(),
                retokenize: Some(retokenize),
                detokenize: Some(detokenize),
            };
            Arc::new(move || {
                ExternalEngine::start(cfg.clone(), info.clone())
                    .map(|e| Arc::new(e) as Arc<dyn Engine>)
                    .map_err(|e| e.to_string())
            })
        }
    })
}
