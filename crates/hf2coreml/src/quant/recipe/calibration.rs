//! The `[calibration]` table of a recipe: which calibrated methods fit the palettized
//! projections, and their settings.

use serde::Serialize;

use super::recipe_error::RecipeError;

/// The `[calibration]` table: palettized projections are fitted to what they compute on
/// calibration text (see [`crate::quant::calibrate`]). Absent = data-free palettization.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Calibration {
    /// Per-output-row fp16 scale, one `mul` after the linear.
    pub row_scale: bool,
    /// k-means points weighted by E[x²] of their input channel.
    pub weighted: bool,
    /// GPTQ error feedback when choosing indices.
    pub gptq: bool,
    /// GPTQ columns in order of decreasing E[x²].
    pub act_order: bool,
    /// AWQ-style input-channel scales folded into the preceding norm/projection.
    pub awq: bool,
    /// Contiguous row groups per projection, each with its own LUT.
    pub row_groups: usize,
    /// iOS18: rows per LUT group (0 = use `row_groups`); groups of equal size in row order
    /// are stored as one grouped LUT.
    pub group_size: usize,
    /// Rotate each projection's input channels (see `LinearMethod::rotate`): the graph
    /// rotates each projection input once (signs, Hadamard blocks, a mix across blocks).
    pub rotate: bool,
    /// GPTQ Hessian damping relative to its mean diagonal.
    pub damp: f64,
    /// Mixed precision: 4/6/8 bits per row of each projection so they average at most this.
    pub target_bpw: Option<f64>,
    /// Mixed precision hands out bits by chunks of this many rows of a projection (its rows
    /// ranked by the error 6 bits would remove); 0: whole projections.
    pub allocation_rows: usize,
    /// Calibrate on at most this many tokens of the text (the first ones): calibration time
    /// grows linearly with them. `None`: all of it.
    pub tokens: Option<usize>,
}

/// Rows per unit of the mixed-precision allocation: whole projections. Chunks of rows lower
/// KL a little on SmolLM2 at 4.5 bits per weight but not top-1, and cost each mixed
/// projection a linear per width and a gather on device (docs/quality.md, "Mixed precision
/// by rows").
pub const DEFAULT_ALLOCATION_ROWS: usize = 0;

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            row_scale: true,
            weighted: true,
            gptq: true,
            act_order: true,
            // Measured on SmolLM2: no gain once GPTQ and row scales are on (docs/quality.md).
            awq: false,
            row_groups: 1,
            group_size: 0,
            rotate: false,
            damp: 0.01,
            target_bpw: None,
            allocation_rows: DEFAULT_ALLOCATION_ROWS,
            tokens: None,
        }
    }
}

impl Calibration {
    /// The per-layer method for a projection palettized at `nbits`.
    pub fn method(&self, nbits: u8) -> crate::quant::calibrate::LinearMethod {
        crate::quant::calibrate::LinearMethod {
            nbits,
            row_scale: self.row_scale,
            weighted: self.weighted,
            gptq: self.gptq,
            act_order: self.act_order,
            damp: self.damp,
            row_groups: self.row_groups,
            group_size: self.group_size,
            rotate: self.rotate,
        }
    }

    pub(super) fn parse(value: &toml::Value) -> Result<Self, RecipeError> {
        let t = value
            .as_table()
            .ok_or("`calibration` must be a table ([calibration])")?;
        let mut c = Calibration::default();
        for (k, v) in t {
            let flag = |v: &toml::Value| {
                v.as_bool()
                    .ok_or_else(|| format!("calibration.{k} must be true or false"))
            };
            match k.as_str() {
                "row_scale" => c.row_scale = flag(v)?,
                "weighted" => c.weighted = flag(v)?,
                "gptq" => c.gptq = flag(v)?,
                "act_order" => c.act_order = flag(v)?,
                "awq" => c.awq = flag(v)?,
                "rotate" => c.rotate = flag(v)?,
                "row_groups" => {
                    c.row_groups = v
                        .as_integer()
                        .filter(|&g| (1..=256).contains(&g))
                        .ok_or("calibration.row_groups must be an integer in 1..=256")?
                        as usize
                }
                "group_size" => {
                    c.group_size = v
                        .as_integer()
                        .filter(|&g| (1..=4096).contains(&g))
                        .ok_or("calibration.group_size must be an integer in 1..=4096")?
                        as usize
                }
                "target_bpw" => {
                    c.target_bpw = Some(
                        v.as_float()
                            .or_else(|| v.as_integer().map(|i| i as f64))
                            .filter(|b| b.is_finite() && (4.0..=8.5).contains(b))
                            .ok_or("calibration.target_bpw must be a number in 4..=8.5")?,
                    )
                }
                "allocation_rows" => {
                    c.allocation_rows = v
                        .as_integer()
                        .filter(|&r| (0..=65_536).contains(&r))
                        .ok_or("calibration.allocation_rows must be an integer in 0..=65536")?
                        as usize
                }
                "tokens" => {
                    c.tokens = Some(
                        v.as_integer()
                            .filter(|&t| t >= 256)
                            .ok_or("calibration.tokens must be an integer of at least 256")?
                            as usize,
                    )
                }
                "damp" => {
                    c.damp = v
                        .as_float()
                        .filter(|d| d.is_finite() && *d > 0.0 && *d <= 1.0)
                        .ok_or("calibration.damp must be a float in (0, 1]")?
                }
                other => {
                    return Err(RecipeError::Invalid(format!(
                        "calibration: unknown key `{other}` (expected row_scale, weighted, \
                         gptq, act_order, awq, rotate, row_groups, group_size, damp, target_bpw, \
                         allocation_rows, tokens)"
                    )))
                }
            }
        }
        Ok(c)
    }

    pub(super) fn to_toml(self) -> String {
        let target = self
            .target_bpw
            .map_or(String::new(), |b| format!("target_bpw = {b}\n"))
            + &self
                .tokens
                .map_or(String::new(), |t| format!("tokens = {t}\n"))
            + if self.rotate { "rotate = true\n" } else { "" }
            + &if self.group_size > 0 {
                format!("group_size = {}\n", self.group_size)
            } else {
                String::new()
            }
            + &if self.allocation_rows != DEFAULT_ALLOCATION_ROWS {
                format!("allocation_rows = {}\n", self.allocation_rows)
            } else {
                String::new()
            };
        format!(
            "\n[calibration]\nrow_scale = {}\nweighted = {}\ngptq = {}\nact_order = {}\n\
             awq = {}\nrow_groups = {}\ndamp = {}\n",
            self.row_scale,
            self.weighted,
            self.gptq,
            self.act_order,
            self.awq,
            self.row_groups,
            self.damp
        ) + &target
    }
}

#[cfg(test)]
mod tests {
    use super::super::Recipe;
    use crate::mil::PackageOptions;

    #[test]
    fn allocation_rows_parses_round_trips_and_is_checked() {
        let text = "default = \"fp16\"\n[calibration]\ntarget_bpw = 4.5\nallocation_rows = 16\n";
        let r = Recipe::parse(text, "t").unwrap();
        let c = r.calibration().unwrap();
        assert_eq!((c.allocation_rows, c.target_bpw), (16, Some(4.5)));
        let back = Recipe::parse(&r.to_toml(&PackageOptions::default()), "round-trip").unwrap();
        assert_eq!(back.calibration(), r.calibration());
        let plain = Recipe::parse("default = \"fp16\"\n[calibration]\n", "t").unwrap();
        assert_eq!(plain.calibration().unwrap().allocation_rows, 0);
        let bad = Recipe::parse(
            "default = \"fp16\"\n[calibration]\nallocation_rows = -1\n",
            "t",
        );
        assert!(bad.unwrap_err().to_string().contains("allocation_rows"));
    }
}
