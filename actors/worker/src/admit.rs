//! Whether a worker takes a generate request: the synchronous checks the
//! actor runs before it starts anything (decoded message, state, model,
//! deadline, duplicates, room, limits).
//!
//! Invariants: a request is admitted only while the worker is `Serving`,
//! for its own model, before its deadline, not already running, with fewer
//! than `max_inflight` requests in flight, and only as a [`ValidRequest`];
//! every refusal carries the kind the gateway acts on (`Unavailable` and
//! `Overloaded` are retried elsewhere, the rest fail the request).

use dynamo_bus_schema::{
    decode, peek_kind, DecodeError, ErrorKind, GenerateDisagg, GenerateRequest, ModelName,
    RequestId, WireError, WireMessage, WorkerState,
};
use dynamo_engine::{EngineLimits, ValidRequest};
use std::collections::HashSet;

/// What the checks look at.
pub struct Admission<'a> {
    pub state: WorkerState,
    pub model: &'a ModelName,
    pub limits: EngineLimits,
    pub inflight: &'a HashSet<RequestId>,
    /// Requests the worker holds at once (its engine's capacity).
    pub max_inflight: usize,
}

/// Decodes a generate message: a plain request or a disaggregated one.
pub fn parse(payload: &[u8]) -> Result<(GenerateRequest, Option<GenerateDisagg>), DecodeError> {
    match peek_kind(payload) {
        Ok((k, _)) if k == GenerateDisagg::KIND => {
            decode::<GenerateDisagg>(payload).map(|d| (d.request.clone(), Some(d)))
        }
        _ => decode::<GenerateRequest>(payload).map(|r| (r, None)),
    }
}

/// The request id a message names, if it can be read at all (to refuse it).
pub fn request_id(payload: &[u8]) -> Option<RequestId> {
    parse(payload).ok().map(|(r, _)| r.request_id)
}

impl Admission<'_> {
    /// Admits `req` at `now_unix_ms`, or says why not.
    pub fn check(
        &self,
        req: &GenerateRequest,
        now_unix_ms: u64,
    ) -> Result<ValidRequest, WireError> {
        let id = req.request_id;
        match self.state {
            WorkerState::Serving => {}
            WorkerState::Draining => {
                return Err(WireError::new(ErrorKind::Unavailable, "worker is draining"))
            }
            WorkerState::Starting => {
                return Err(WireError::new(
                    ErrorKind::Unavailable,
                    "worker is starting (its engine is loading)",
                ))
            }
            _ => {
                return Err(WireError::new(
                    ErrorKind::Unavailable,
                    "worker is not serving (its engine is restarting)",
                ))
            }
        }
        if &req.model != self.model {
            return Err(WireError::new(
                ErrorKind::InvalidRequest,
                format!("this worker serves {}, not {}", self.model, req.model),
            ));
        }
        if req.deadline_unix_ms != 0 && req.deadline_unix_ms <= now_unix_ms {
            return Err(WireError::new(
                ErrorKind::DeadlineExceeded,
                "deadline passed before admission",
            ));
        }
        if self.inflight.contains(&id) {
            return Err(WireError::new(
                ErrorKind::InvalidRequest,
                format!("request {id} is already running"),
            ));
        }
        if self.inflight.len() >= self.max_inflight {
            return Err(WireError::new(
                ErrorKind::Overloaded,
                format!(
                    "the worker holds {} requests, its limit",
                    self.inflight.len()
                ),
            ));
        }
        ValidRequest::parse(req, self.limits)
            .map_err(|e| WireError::new(ErrorKind::InvalidRequest, e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_bus_schema::SamplingParams;

    fn req(id: u128) -> GenerateRequest {
        GenerateRequest {
            request_id: RequestId(id),
            model: ModelName("m".into()),
            token_ids: vec![1, 2],
            sampling: SamplingParams::greedy(4),
            reply_to: "r".into(),
            deadline_unix_ms: 0,
        }
    }

    #[test]
    fn each_refusal_has_the_kind_the_gateway_acts_on() {
        let model = ModelName("m".into());
        let mut inflight = HashSet::new();
        inflight.insert(RequestId(1));
        let limits = EngineLimits {
            context_length: 16,
            vocab_size: 10,
        };
        let a = |state, max_inflight, inflight| Admission {
            state,
            model: &model,
            limits,
            inflight,
            max_inflight,
        };
        let ok = a(WorkerState::Serving, 4, &inflight);
        assert!(ok.check(&req(2), 0).is_ok());
        let kind = |r: Result<ValidRequest, WireError>| r.unwrap_err().kind;
        assert_eq!(kind(ok.check(&req(1), 0)), ErrorKind::InvalidRequest);
        assert_eq!(
            kind(a(WorkerState::Draining, 4, &inflight).check(&req(2), 0)),
            ErrorKind::Unavailable
        );
        assert_eq!(
            kind(a(WorkerState::Failed, 4, &inflight).check(&req(2), 0)),
            ErrorKind::Unavailable
        );
        assert_eq!(
            kind(a(WorkerState::Serving, 1, &inflight).check(&req(2), 0)),
            ErrorKind::Overloaded
        );
        let mut late = req(2);
        late.deadline_unix_ms = 5;
        assert_eq!(kind(ok.check(&late, 9)), ErrorKind::DeadlineExceeded);
        let mut other = req(2);
        other.model = ModelName("x".into());
        assert_eq!(kind(ok.check(&other, 0)), ErrorKind::InvalidRequest);
        let mut long = req(2);
        long.sampling.max_tokens = 100;
        assert_eq!(kind(ok.check(&long, 0)), ErrorKind::InvalidRequest);
        assert!(parse(b"junk").is_err());
        assert_eq!(
            request_id(&dynamo_bus_schema::encode(&req(7)).unwrap()),
            Some(RequestId(7))
        );
    }
}
