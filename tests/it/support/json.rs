//! Reading what the test generators record: logit rows and token ids as JSON arrays.

/// `[[f, ...], ...]`: one row of logits per position.
pub fn rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("an array of rows")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("a row")
                .iter()
                .map(|x| x.as_f64().expect("a number") as f32)
                .collect()
        })
        .collect()
}

/// `[id, ...]`.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|t| t.as_u64().expect("an id") as u32)
        .collect()
}
