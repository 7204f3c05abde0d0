//! The step every model that follows the package contract takes (docs/contract.md): the
//! interpreted [`Package`](crate::Package) implements it, and so does anything else the runtime
//! steps (an `.aimodel` on Apple's runtime, a chain of packages).

use half::f16;

use crate::compile::RuntimeError;

/// One step of a model that follows the package contract (docs/contract.md): the interpreted
/// package implements it, and so can anything else that follows the contract (a reference, a
/// Core ML backend on macOS).
pub trait StepModel {
    /// The dimensions and token ids the model was built with.
    fn contract(&self) -> &crate::mil::contract::Contract;

    /// The Q of a second function for prompts (a multifunction package's `prefill`): `step`
    /// then also takes exactly that many tokens. `None`: every call takes the contract's Q.
    fn prefill_len(&self) -> Option<usize> {
        None
    }

    /// Whether the prefill function returns the logits of its last position only (one row,
    /// not [`StepModel::prefill_len`]): the host then ends a prompt's last prefill call on its
    /// last token, or decodes that token.
    fn prefill_last_row_only(&self) -> bool {
        false
    }

    /// Run tokens `input_ids` (exactly Q of them, or [`StepModel::prefill_len`]) at absolute
    /// positions `position .. position + Q`, reading cache rows `[0, position)` of `key_cache`/`value_cache`
    /// ([L, Hkv, S, D], row-major).
    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError>;

    /// A hybrid model's step (the contract's `recurrent`): as [`step`](Self::step), but only
    /// the first `valid` of `input_ids` are real tokens (the rest padding, which the model
    /// keeps out of its state), and `recurrent` holds the state after the positions before
    /// `position` ([`Contract::recurrent_len`](crate::mil::contract::Contract::recurrent_len)
    /// values, zeros at position 0). The output's `recurrent` is the state after the `valid`
    /// tokens. Models without a recurrent state have no such step.
    fn step_recurrent(
        &mut self,
        input_ids: &[i32],
        valid: usize,
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
        recurrent: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let _ = (
            input_ids,
            valid,
            position,
            key_cache,
            value_cache,
            recurrent,
        );
        Err(RuntimeError::Program(
            "the model carries no recurrent state".into(),
        ))
    }

    /// A stateful model (`kv_cache = "state"`, which ignores the caches `step` is given and
    /// returns no update rows): the first `rows` rows of its cache, [L, Hkv, rows, D] keys and
    /// values. Models without a state have none.
    fn state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        let _ = rows;
        Err(RuntimeError::Program(
            "the model holds no cache state".into(),
        ))
    }

    /// A stateful hybrid model: its recurrent states (conv, then DeltaNet), as the KV-cache
    /// file holds them.
    fn state_recurrent(&self) -> Result<Vec<f16>, RuntimeError> {
        Err(RuntimeError::Program(
            "the model holds no recurrent state".into(),
        ))
    }

    /// A stateful hybrid model: put back what [`state_recurrent`](Self::state_recurrent)
    /// returned.
    fn restore_state_recurrent(&mut self, values: &[f16]) -> Result<(), RuntimeError> {
        let _ = values;
        Err(RuntimeError::Program(
            "the model holds no recurrent state".into(),
        ))
    }

    /// A stateful model: put `keys` and `values` ([L, Hkv, rows, D]) into its cache's first
    /// rows, as [`state_rows`](Self::state_rows) returned them.
    fn restore_state_rows(
        &mut self,
        rows: usize,
        keys: &[f16],
        values: &[f16],
    ) -> Result<(), RuntimeError> {
        let _ = (rows, keys, values);
        Err(RuntimeError::Program(
            "the model holds no cache state".into(),
        ))
    }
}

/// What one step returns.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// [Q, V] next-token logits, row-major ([1, V], the last position's, from a prefill
    /// function that returns one row).
    pub logits: Vec<f32>,
    /// [L, Hkv, Q, D]: rows for cache positions `position .. position + Q`.
    pub key_update: Vec<f16>,
    pub value_update: Vec<f16>,
    /// A hybrid model's recurrent state after the step's real tokens (empty otherwise).
    pub recurrent: Vec<f16>,
}
