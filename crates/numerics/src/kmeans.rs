//! Exact weighted 1-D k-means on 16-bit values. One idea in one file: the solver is under 600
//! lines; its tests make up the rest.
//!
//! A f16 tensor holds at most 63,487 distinct finite values (±0 merged), so instead of iterating
//! Lloyd over millions of elements we histogram the bit patterns, sort the distinct values, and
//! solve the k-partition problem exactly: in 1-D every optimal cluster is a contiguous run of
//! sorted values, segment costs come in O(1) from prefix sums, and the optimal split points are
//! monotone in the right end, so each DP layer is one monotone (divide-and-conquer) search,
//! O(n log n) for n distinct values. The DP runs from both ends to the middle and drops states
//! costlier than a feasible partition, which leaves well under half of the k·n states on real
//! weights. Elements are then assigned by a bit-pattern table.

use half::f16;

use crate::NumericsError;

pub use crate::nbits::{nbits_list, IOS17_NBITS, SUPPORTED_NBITS};

/// Number of 16-bit patterns, the size of the histogram and of the assignment table.
const PATTERNS: usize = 1 << 16;

/// A k-means fit: one tensor (or one channel group) palettized with a single LUT, indices
/// unpacked, with its error (the library stores it as `quant::QuantizedWeight`).
#[derive(Debug, Clone, PartialEq)]
pub struct LutFit {
    pub nbits: u8,
    /// Sorted (non-decreasing), exactly `2^nbits` entries. When the input has fewer distinct
    /// values than entries, the unused tail repeats the largest used entry; no index points at it.
    pub lut: Vec<f16>,
    /// One LUT index per element, unpacked (see [`crate::pack`] for the stored form).
    pub indices: Vec<u8>,
    /// Mean squared error per element of what is actually stored (f16 LUT after re-assignment),
    /// unweighted even when importance weights drove the fit.
    pub mse: f64,
    /// 10·log10(Σx² / Σ(x − x̂)²); `+inf` when the reconstruction is exact.
    pub snr_db: f64,
}

impl LutFit {
    /// The stored tensor: `lut[indices]`.
    pub fn dequantize(&self) -> Vec<f16> {
        self.indices.iter().map(|&i| self.lut[i as usize]).collect()
    }
}

/// Check `nbits` against [`SUPPORTED_NBITS`].
pub fn check_nbits(nbits: u8) -> Result<(), NumericsError> {
    if SUPPORTED_NBITS.contains(&nbits) {
        Ok(())
    } else {
        Err(NumericsError::UnsupportedNbits { nbits })
    }
}

/// Palettize `values` to a sorted f16 LUT of `2^nbits` entries minimising the (weighted) squared
/// error, exactly.
///
/// `weights` are per-element importance weights (`None` = uniform). Elements of weight 0 do not
/// influence the LUT but are still assigned to their nearest entry; if every weight is 0 the fit
/// falls back to uniform weights. Negative or non-finite weights, NaN/Inf values, a length
/// mismatch and unsupported `nbits` are errors.
pub fn palettize_f16(
    values: &[f16],
    nbits: u8,
    weights: Option<&[f32]>,
) -> Result<LutFit, NumericsError> {
    check_nbits(nbits)?;
    if let Some(w) = weights {
        if w.len() != values.len() {
            return Err(NumericsError::WeightsLength {
                values: values.len(),
                weights: w.len(),
            });
        }
    }
    let hist = Histogram::build(values, weights)?;
    let fit = hist.fit(nbits);
    let indices: Vec<u8> = values.iter().map(|&v| fit.index(v)).collect();
    Ok(LutFit {
        nbits,
        lut: fit.lut,
        indices,
        mse: fit.mse,
        snr_db: fit.snr_db,
    })
}

/// A LUT fitted to a histogram of f16 values, and the nearest entry of every f16 pattern: for
/// a tensor too large to hold, whose values are counted chunk by chunk ([`F16Counts`]) and
/// assigned in a second pass.
#[derive(Clone)]
pub struct LutTable {
    pub nbits: u8,
    /// Sorted, `2^nbits` entries (as [`LutFit::lut`]).
    pub lut: Vec<f16>,
    /// Mean squared error per counted value.
    pub mse: f64,
    /// 10·log10(Σx² / Σ(x − x̂)²) over the counted values.
    pub snr_db: f64,
    table: Box<[u8; PATTERNS]>,
}

impl LutTable {
    /// The LUT index of `v`: its nearest entry (any finite f16, counted or not, has one).
    pub fn index(&self, v: f16) -> u8 {
        self.table[v.to_bits() as usize]
    }
}

impl std::fmt::Debug for LutTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LutTable")
            .field("nbits", &self.nbits)
            .field("lut", &self.lut)
            .field("mse", &self.mse)
            .field("snr_db", &self.snr_db)
            .finish_non_exhaustive()
    }
}

/// How often each f16 value occurs, added to chunk by chunk, then fitted exactly and at once
/// ([`F16Counts::fit`]): what [`palettize_f16`] does with uniform weights, for values that
/// never sit in memory together.
#[derive(Debug, Clone)]
pub struct F16Counts {
    counts: Vec<u64>,
}

impl Default for F16Counts {
    fn default() -> Self {
        F16Counts {
            counts: vec![0; PATTERNS],
        }
    }
}

impl F16Counts {
    /// Count `values`.
    pub fn add(&mut self, values: &[f16]) {
        for v in values {
            self.counts[v.to_bits() as usize] += 1;
        }
    }

    /// Add the values `other` counted.
    pub fn merge(&mut self, other: &F16Counts) {
        for (c, o) in self.counts.iter_mut().zip(&other.counts) {
            *c += o;
        }
    }

    /// The optimal LUT of `2^nbits` entries for the counted values: the same as
    /// [`palettize_f16`] of all of them with uniform weights. NaN or Inf among them, or
    /// unsupported `nbits`, is an error.
    pub fn fit(&self, nbits: u8) -> Result<LutTable, NumericsError> {
        check_nbits(nbits)?;
        let bad: u64 = [0x7C00usize, 0xFC00]
            .iter()
            .map(|&e| self.counts[e..e + 0x400].iter().sum::<u64>())
            .sum();
        if bad > 0 {
            return Err(NumericsError::NonFiniteCounted { count: bad });
        }
        let hist = Histogram {
            counts: self.counts.clone(),
            weights: None,
        };
        Ok(hist.fit(nbits))
    }
}

/// 10·log10(signal / error), `+inf` for an exact reconstruction.
pub fn snr_db(signal_sq_sum: f64, err_sq_sum: f64) -> f64 {
    if err_sq_sum <= 0.0 {
        f64::INFINITY
    } else {
        10.0 * (signal_sq_sum / err_sq_sum).log10()
    }
}

/// One distinct value of the tensor (+0 and −0 are one value with two patterns).
struct Distinct {
    value: f64,
    weight: f64,
    count: u64,
    /// The bit patterns of this value: one, or two for ±0 (inline, to avoid 60k allocations).
    patterns: [u16; 2],
    npatterns: usize,
}

struct Histogram {
    counts: Vec<u64>,
    weights: Option<Vec<f64>>,
}

impl Histogram {
    fn build(values: &[f16], weights: Option<&[f32]>) -> Result<Self, NumericsError> {
        let mut counts = vec![0u64; PATTERNS];
        for v in values {
            counts[v.to_bits() as usize] += 1;
        }
        // Non-finite f16 patterns are those with all exponent bits set (2 × 1024 of them): check
        // them in the histogram, not every element, and only then locate the first offender.
        let bad = [0x7C00usize, 0xFC00]
            .iter()
            .any(|&e| counts[e..e + 0x400].iter().any(|&c| c > 0));
        if bad {
            let (index, value) = values
                .iter()
                .enumerate()
                .find(|(_, v)| !v.is_finite())
                .map(|(i, v)| (i, v.to_f32()))
                .unwrap_or((0, f32::NAN));
            return Err(NumericsError::NonFinite { index, value });
        }
        let weights = match weights {
            None => None,
            Some(ws) => {
                let mut acc = vec![0f64; PATTERNS];
                for (i, (v, &w)) in values.iter().zip(ws).enumerate() {
                    if !(w.is_finite() && w >= 0.0) {
                        return Err(NumericsError::BadWeight {
                            index: i,
                            weight: w,
                        });
                    }
                    acc[v.to_bits() as usize] += w as f64;
                }
                Some(acc)
            }
        };
        Ok(Histogram { counts, weights })
    }

    /// The exact fit of `2^nbits` entries to the histogram, and every pattern's nearest entry.
    fn fit(&self, nbits: u8) -> LutTable {
        let distinct = self.distinct_values();
        let k = 1usize << nbits;

        // Cluster means in f64, from the exact DP over the weighted distinct values.
        let fit: Vec<(f64, f64)> = distinct
            .iter()
            .filter(|d| d.weight > 0.0)
            .map(|d| (d.value, d.weight))
            .collect();
        let fit = if fit.is_empty() {
            // every weight is zero (or the tensor is empty): fall back to plain counts.
            distinct.iter().map(|d| (d.value, d.count as f64)).collect()
        } else {
            fit
        };
        let centers = optimal_centers(&fit, k);

        // The LUT is f16: round the means, then re-assign every distinct value to its nearest
        // stored entry, because rounding can move the boundary between two neighbouring
        // clusters.
        let mut lut: Vec<f16> = centers.iter().map(|&c| f16::from_f64(c)).collect();
        lut.sort_by(|a, b| a.total_cmp(b));
        let used = lut.len();
        let pad = lut.last().copied().unwrap_or(f16::ZERO);
        lut.resize(k, pad);
        let lut_f64: Vec<f64> = lut[..used.max(1)].iter().map(|v| v.to_f64()).collect();

        // A fixed-size table: indexing it with a u16 needs no bounds check in the per-element
        // loop.
        let mut table: Box<[u8; PATTERNS]> = Box::new([0u8; PATTERNS]);
        let mut err_sum = 0.0f64;
        let mut sig_sum = 0.0f64;
        let mut j = 0usize;
        for d in &distinct {
            // distinct values are ascending, so the nearest entry only moves right.
            while j + 1 < lut_f64.len()
                && (lut_f64[j + 1] - d.value).abs() < (lut_f64[j] - d.value).abs()
            {
                j += 1;
            }
            for &p in &d.patterns[..d.npatterns] {
                table[p as usize] = j as u8;
            }
            let e = d.value - lut_f64[j];
            err_sum += d.count as f64 * e * e;
            sig_sum += d.count as f64 * d.value * d.value;
        }
        let n = self.counts.iter().sum::<u64>().max(1) as f64;
        LutTable {
            nbits,
            lut,
            mse: err_sum / n,
            snr_db: snr_db(sig_sum, err_sum),
            table,
        }
    }

    /// Present values, ascending, with their accumulated weights.
    fn distinct_values(&self) -> Vec<Distinct> {
        // Sign-magnitude order: negative patterns from the largest magnitude (0xFBFF, the
        // largest finite) down to −0 (0x8000), then +0 up to 0x7BFF. Non-finite patterns were
        // rejected in `build`, so their counts are zero and they are skipped with the rest.
        let present: Vec<u16> = (0x8000u16..=0xFFFF)
            .rev()
            .chain(0x0000u16..=0x7FFF)
            .filter(|&p| self.counts[p as usize] > 0)
            .collect();
        let mut out: Vec<Distinct> = Vec::with_capacity(present.len());
        for p in present {
            let value = f16::from_bits(p).to_f64();
            let count = self.counts[p as usize];
            let weight = match &self.weights {
                Some(w) => w[p as usize],
                None => count as f64,
            };
            match out.last_mut() {
                // −0 and +0 sort next to each other and are the same value.
                Some(last) if last.value == value => {
                    last.weight += weight;
                    last.count += count;
                    last.patterns[1] = p;
                    last.npatterns = 2;
                }
                _ => out.push(Distinct {
                    value,
                    weight,
                    count,
                    patterns: [p, p],
                    npatterns: 1,
                }),
            }
        }
        out
    }
}

/// Prefix sums of w, w·y, w·y² over the sorted points, with y centred on the weighted mean so
/// the O(1) segment cost does not cancel catastrophically for values far from zero.
struct Prefix {
    w: Vec<f64>,
    s1: Vec<f64>,
    s2: Vec<f64>,
}

impl Prefix {
    fn new(points: &[(f64, f64)], shift: f64) -> Self {
        let n = points.len();
        let (mut w, mut s1, mut s2) = (
            Vec::with_capacity(n + 1),
            Vec::with_capacity(n + 1),
            Vec::with_capacity(n + 1),
        );
        let (mut a, mut b, mut c) = (0.0f64, 0.0f64, 0.0f64);
        w.push(0.0);
        s1.push(0.0);
        s2.push(0.0);
        for &(x, wt) in points {
            let y = x - shift;
            a += wt;
            b += wt * y;
            c += wt * y * y;
            w.push(a);
            s1.push(b);
            s2.push(c);
        }
        Prefix { w, s1, s2 }
    }

    /// Number of points.
    fn len(&self) -> usize {
        self.w.len() - 1
    }

    /// Weighted squared error of points `i..j` around their weighted mean.
    #[inline(always)]
    fn cost(&self, i: usize, j: usize) -> f64 {
        let w = self.w[j] - self.w[i];
        if w <= 0.0 {
            return 0.0;
        }
        let s1 = self.s1[j] - self.s1[i];
        let s2 = self.s2[j] - self.s2[i];
        (s2 - s1 * s1 / w).max(0.0)
    }

    /// Weighted mean of points `i..j` (in the original, unshifted coordinates).
    fn mean(&self, i: usize, j: usize, shift: f64) -> f64 {
        let w = self.w[j] - self.w[i];
        shift + (self.s1[j] - self.s1[i]) / w
    }
}

/// The cluster means of an optimal partition of sorted, strictly increasing `points`
/// `(value, weight > 0)` into at most `k` contiguous clusters, ascending.
///
/// The DP runs from both ends and meets in the middle: `F_c(j)`, the best cost of the first `j`
/// points in `c` clusters, for `c ≤ k/2`, and the same on the mirrored points for the other
/// `k − k/2` clusters; the optimum is `min_j F(j) + G(n − j)`. Every state on an optimal path
/// costs at most the optimum, so states above the cost of any feasible partition (a few Lloyd
/// steps from weighted quantiles) are dropped. `F_c` grows with `j`, so that cut ends each layer
/// early: on real weights the two halves touch about 6 rows per point instead of the 14 of the
/// one-sided DP at 4 bits.
pub(crate) fn optimal_centers(points: &[(f64, f64)], k: usize) -> Vec<f64> {
    let n = points.len();
    if n == 0 {
        return Vec::new();
    }
    if n <= k {
        return points.iter().map(|p| p.0).collect();
    }
    let total_w: f64 = points.iter().map(|p| p.1).sum();
    let shift = points.iter().map(|p| p.0 * p.1).sum::<f64>() / total_w;
    let pre = Prefix::new(points, shift);
    if k == 1 {
        return vec![pre.mean(0, n, shift)];
    }
    let mirrored: Vec<(f64, f64)> = points.iter().rev().map(|&(x, w)| (-x, w)).collect();
    let pre_rev = Prefix::new(&mirrored, -shift);
    let (front, back) = (k / 2, k - k / 2);

    // The cut only has to clear f64 rounding of the prefix-sum costs, which scales with the
    // total spread; 1e-9 of it is orders of magnitude above that and far below any real gap.
    let spread = pre.cost(0, n);
    let cutoff = lloyd_upper_bound(&pre, points, shift, k) + CUT_MARGIN * spread;
    // Prefix sums that overflowed (absurd importance weights) give no usable bound: no cut.
    let cutoff = if cutoff.is_finite() {
        cutoff
    } else {
        f64::INFINITY
    };
    // The optimal path always survives a valid bound; solving without the cut keeps this
    // exact even if rounding ever proved that wrong. Without a cut some j always meets.
    let Some((fwd, bwd, j)) = meet(&pre, &pre_rev, front, back, cutoff)
        .or_else(|| meet(&pre, &pre_rev, front, back, f64::INFINITY))
    else {
        return vec![pre.mean(0, n, shift)];
    };

    let mut bounds = fwd.backtrack(j, n);
    bounds.extend(bwd.backtrack(n - j, n).iter().rev().skip(1).map(|&q| n - q));
    bounds
        .windows(2)
        .filter(|b| b[1] > b[0])
        .map(|b| pre.mean(b[0], b[1], shift))
        .collect()
}

/// Relative (to the one-cluster cost) slack on the pruning bound; see [`optimal_centers`].
const CUT_MARGIN: f64 = 1e-9;

/// Solve both halves and find the best meeting point: `(front, back, j)`, `None` when no
/// meeting point survived `cutoff`.
fn meet(
    pre: &Prefix,
    pre_rev: &Prefix,
    front: usize,
    back: usize,
    cutoff: f64,
) -> Option<(Half, Half, usize)> {
    let n = pre.len();
    let fwd = Half::solve(pre, front, cutoff);
    let bwd = Half::solve(pre_rev, back, cutoff);
    let (mut best, mut arg) = (f64::INFINITY, None);
    for j in front..=n - back {
        let v = fwd.last[j] + bwd.last[n - j];
        if v < best {
            best = v;
            arg = Some(j);
        }
    }
    arg.map(|j| (fwd, bwd, j))
}

/// A cost bound from a feasible partition: Lloyd iterations on the sorted points, each one a
/// few binary searches and prefix-sum means (O(k log n)), from weighted-quantile clusters.
fn lloyd_upper_bound(pre: &Prefix, points: &[(f64, f64)], shift: f64, k: usize) -> f64 {
    const ITERATIONS: usize = 30;
    let n = pre.len();
    let total = pre.w[n];
    let mut bounds: Vec<usize> = (0..=k)
        .map(|t| pre.w.partition_point(|&w| w < total * t as f64 / k as f64))
        .collect();
    bounds[0] = 0;
    bounds[k] = n;
    let cost_of = |b: &[usize]| b.windows(2).map(|s| pre.cost(s[0], s[1])).sum::<f64>();
    let mut best = cost_of(&bounds);
    let mut means = Vec::with_capacity(k);
    for _ in 0..ITERATIONS {
        means.clear();
        means.extend(
            bounds
                .windows(2)
                .filter(|s| s[1] > s[0])
                .map(|s| pre.mean(s[0], s[1], shift)),
        );
        let mut next = vec![n; k + 1];
        next[0] = 0;
        for (t, m) in means.windows(2).enumerate() {
            let mid = 0.5 * (m[0] + m[1]);
            next[t + 1] = points.partition_point(|p| p.0 <= mid);
        }
        if next == bounds {
            break;
        }
        bounds = next;
        best = best.min(cost_of(&bounds));
    }
    best
}

/// One direction of the DP: `layers` cluster counts over the first `j` points.
struct Half {
    /// Points + 1 entries per layer, layer-major: where the last of `c` clusters over the
    /// first `j` points starts, at `(c − 1)·(n + 1) + j` (layer 1 is all zeros).
    splits: Vec<u32>,
    /// `F_layers(j)`; `+inf` where cut.
    last: Vec<f64>,
}

impl Half {
    /// Layer `c` is `F_c(j) = min_i F_{c−1}(i) + cost(i, j)`; the leftmost optimal `i` is
    /// monotone in `j` (the cost is Monge), so rows are solved coarse to fine: at stride `s`,
    /// row `j` only searches between the splits already found at `j − s` and `j + s`. That is
    /// the classic divide-and-conquer walked level by level: no stack, sequential memory at the
    /// fine levels where most rows are, and searches there a few candidates wide (about 3 at
    /// the finest level on real weights), which [`Rows::min`] does without branches. Knuth–Yao
    /// (the last of `c` clusters starts no earlier than the last of `c − 1`) bounds rows from
    /// below too.
    ///
    /// Rows above `cutoff` are dropped with every row after them (`F_c` grows with `j`); the
    /// search then runs over a column prefix of the Monge matrix, which is still monotone, and
    /// every surviving row is exact.
    fn solve(pre: &Prefix, layers: usize, cutoff: f64) -> Half {
        let n = pre.len();
        let row = n + 1;
        let (w, s1, s2) = (&pre.w[..], &pre.s1[..], &pre.s2[..]);
        let mut prev: Vec<f64> = (0..=n).map(|j| pre.cost(0, j)).collect();
        // Rows of the previous layer below `prev_end` are within the cut (and exact).
        let mut prev_end = prev.partition_point(|&v| v <= cutoff).max(1);
        let mut cur = vec![f64::INFINITY; row];
        // The search minimises a[i] − (s1[j] − s1[i])² / (w[j] − w[i]) with
        // a[i] = F_{c−1}(i) − s2[i], the cost's j-only term s2[j] added once per row.
        let mut a = vec![0.0f64; row];
        let mut splits = vec![0u32; layers * row];
        for c in 2..=layers {
            for ((a, p), s2) in a.iter_mut().zip(&prev).zip(s2) {
                *a = p - s2;
            }
            let (done, rest) = splits.split_at_mut((c - 1) * row);
            let lower = &done[(c - 2) * row..];
            let split = &mut rest[..row];
            split.fill(UNSOLVED);
            cur.fill(f64::INFINITY);
            let rows = Rows { w, s1, a: &a };
            // Candidate splits i: c−1 ..= j−1, and only rows of the previous layer in the cut.
            let col_end = prev_end;
            // Rows j = c..=n at positions p = j − c + 1.
            let r = n - c + 1;
            // The first row found above the cutoff, and its split (an upper bound for rows
            // before it whose right neighbour was dropped).
            let mut limit = (n + 1, n - 1);
            let mut s = 1usize << (usize::BITS - 1 - r.leading_zeros());
            loop {
                for p in (s..=r).step_by(2 * s) {
                    let j = p + c - 1;
                    if j >= limit.0 {
                        break;
                    }
                    let left = if p > s { split[j - s] as usize } else { c - 1 };
                    let right = match split.get(j + s) {
                        Some(&x) if p + s <= r && x != UNSOLVED => x as usize,
                        _ if p + s <= r => limit.1,
                        _ => n - 1,
                    };
                    let hi = right.min(j - 1).min(col_end - 1);
                    // Knuth–Yao holds for rows the previous layer solved exactly.
                    let below = if j < prev_end { lower[j] as usize } else { 0 };
                    let lo = left.max(below).min(hi);
                    let (best, arg) = rows.min(lo, hi, j);
                    let v = best + s2[j];
                    cur[j] = v;
                    split[j] = arg as u32;
                    if v > cutoff && j < limit.0 {
                        limit = (j, arg);
                    }
                }
                if s == 1 {
                    break;
                }
                s /= 2;
            }
            let end = limit.0.min(n + 1);
            cur[end..].fill(f64::INFINITY);
            prev_end = end;
            std::mem::swap(&mut prev, &mut cur);
        }
        Half { splits, last: prev }
    }

    /// Boundaries `0 = b_0 < … < b_layers = j` of the solution ending at row `j`, ascending.
    fn backtrack(&self, j: usize, n: usize) -> Vec<usize> {
        let row = n + 1;
        let layers = self.splits.len() / row;
        let mut bounds = Vec::with_capacity(layers + 1);
        let mut j = j;
        for c in (0..layers).rev() {
            bounds.push(j);
            j = if c == 0 {
                0
            } else {
                self.splits[c * row + j] as usize
            };
        }
        bounds.push(0);
        bounds.reverse();
        bounds
    }
}

/// Marks rows a layer did not solve (dropped by the cut).
const UNSOLVED: u32 = u32::MAX;

/// One DP layer's search data: prefix sums and `a[i] = F_{c−1}(i) − s2[i]`.
struct Rows<'a> {
    w: &'a [f64],
    s1: &'a [f64],
    a: &'a [f64],
}

/// Independent minima kept in [`Rows::min`]'s long scans: the divisions of neighbouring
/// candidates overlap instead of queueing behind one running minimum.
const LANES: usize = 4;

impl Rows<'_> {
    /// Leftmost argmin over `i` in `lo..=hi` (`lo ≤ hi < j`) of
    /// `a[i] − (s1[j] − s1[i])² / (w[j] − w[i])`, with its value.
    #[inline(always)]
    fn min(&self, lo: usize, hi: usize, j: usize) -> (f64, usize) {
        let (wj, s1j) = (self.w[j], self.s1[j]);
        if hi - lo < LANES {
            // Fixed four candidates, clamped to hi: repeats are harmless (same value, same
            // index) and the loop-exit mispredictions of these tiny searches disappear.
            let v = |i: usize| {
                let d = s1j - self.s1[i];
                self.a[i] - d * d / (wj - self.w[i])
            };
            let (i1, i2, i3) = ((lo + 1).min(hi), (lo + 2).min(hi), (lo + 3).min(hi));
            let (v0, v1, v2, v3) = (v(lo), v(i1), v(i2), v(i3));
            let (b01, a01) = if v1 < v0 { (v1, i1) } else { (v0, lo) };
            let (b23, a23) = if v3 < v2 { (v3, i3) } else { (v2, i2) };
            return if b23 < b01 { (b23, a23) } else { (b01, a01) };
        }
        let (w, s1, a) = (&self.w[lo..=hi], &self.s1[lo..=hi], &self.a[lo..=hi]);
        let mut best = [f64::INFINITY; LANES];
        // Indices as f64 (exact below 2^53) so the compiler keeps value and index in one
        // vector type and selects both with the same mask.
        let mut arg = [0.0f64; LANES];
        let mut base = 0.0f64;
        let chunks = w
            .chunks_exact(LANES)
            .zip(s1.chunks_exact(LANES))
            .zip(a.chunks_exact(LANES));
        for ((wc, sc), ac) in chunks {
            for l in 0..LANES {
                let d = s1j - sc[l];
                let v = ac[l] - d * d / (wj - wc[l]);
                let better = v < best[l];
                best[l] = if better { v } else { best[l] };
                arg[l] = if better { base + l as f64 } else { arg[l] };
            }
            base += LANES as f64;
        }
        let (mut bv, mut bi) = (f64::INFINITY, 0usize);
        for l in 0..LANES {
            let i = arg[l] as usize;
            if best[l] < bv || (best[l] == bv && i < bi) {
                bv = best[l];
                bi = i;
            }
        }
        // The tail after the last full chunk has larger indices: strict < keeps leftmost.
        for i in (w.len() / LANES) * LANES..w.len() {
            let d = s1j - s1[i];
            let v = a[i] - d * d / (wj - w[i]);
            if v < bv {
                bv = v;
                bi = i;
            }
        }
        (bv, lo + bi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_added_in_chunks_fit_what_one_palettization_fits() {
        let values: Vec<f16> = (0..5000)
            .map(|i| f16::from_f32(((i * 7919) % 1013) as f32 / 97.0 - 5.0))
            .collect();
        let (mut counts, mut rest) = (F16Counts::default(), F16Counts::default());
        for (i, chunk) in values.chunks(333).enumerate() {
            [&mut counts, &mut rest][i % 2].add(chunk);
        }
        counts.merge(&rest);
        for nbits in [4, 8] {
            let whole = palettize_f16(&values, nbits, None).unwrap();
            let table = counts.fit(nbits).unwrap();
            assert_eq!(table.lut, whole.lut);
            assert_eq!((table.mse, table.snr_db), (whole.mse, whole.snr_db));
            let indices: Vec<u8> = values.iter().map(|&v| table.index(v)).collect();
            assert_eq!(indices, whole.indices);
        }
        counts.add(&[f16::INFINITY, f16::NAN]);
        assert!(matches!(
            counts.fit(4),
            Err(NumericsError::NonFiniteCounted { count: 2 })
        ));
        assert!(counts.fit(5).is_err());
    }

    /// The solvers sum the same f64 terms in different orders (and the fast one drops the
    /// clamp at zero), so equal optima agree to rounding, far below this.
    const DP_REL_TOL: f64 = 1e-9;

    /// Exhaustive optimum over every contiguous partition of sorted points into ≤ k clusters
    /// (optimal 1-D clusters are contiguous, so this is the optimum over all partitions).
    fn brute_force_cost(points: &[(f64, f64)], k: usize) -> f64 {
        fn go(points: &[(f64, f64)], k: usize) -> f64 {
            let seg = |s: &[(f64, f64)]| {
                let w: f64 = s.iter().map(|p| p.1).sum();
                let m = s.iter().map(|p| p.0 * p.1).sum::<f64>() / w;
                s.iter().map(|p| p.1 * (p.0 - m).powi(2)).sum::<f64>()
            };
            if points.is_empty() {
                return 0.0;
            }
            if k == 1 {
                return seg(points);
            }
            (1..=points.len())
                .map(|cut| seg(&points[..cut]) + go(&points[cut..], k - 1))
                .fold(f64::INFINITY, f64::min)
        }
        go(points, k)
    }

    fn cost_of(points: &[(f64, f64)], centers: &[f64]) -> f64 {
        points
            .iter()
            .map(|&(x, w)| {
                let d = centers
                    .iter()
                    .map(|c| (x - c).powi(2))
                    .fold(f64::INFINITY, f64::min);
                w * d
            })
            .sum()
    }

    #[test]
    fn widths_read_as_prose() {
        assert_eq!(nbits_list(), "1, 2, 3, 4, 6 or 8");
    }

    #[test]
    fn dp_matches_brute_force_on_small_inputs() {
        let mut rng = crate::SplitMix64(7);
        for trial in 0..300 {
            let n = 1 + (rng.next_u64() % 11) as usize;
            let k = 1 + (rng.next_u64() % 5) as usize;
            let mut xs: Vec<f64> = (0..n).map(|_| rng.normal() as f64).collect();
            xs.sort_by(f64::total_cmp);
            xs.dedup();
            let points: Vec<(f64, f64)> = xs
                .iter()
                .map(|&x| (x, 0.1 + rng.uniform() as f64 * 3.0))
                .collect();
            let ours = cost_of(&points, &optimal_centers(&points, k));
            let best = brute_force_cost(&points, k);
            // The DP sums the same terms in a different order: f64 rounding only.
            assert!(
                ours <= best * (1.0 + 1e-9) + 1e-12,
                "trial {trial}: n={n} k={k} ours={ours} best={best}"
            );
        }
    }

    /// Plain O(k·n²) DP without any monotonicity pruning.
    fn quadratic_dp_cost(points: &[(f64, f64)], k: usize) -> f64 {
        quadratic_dp_rows(points, k)[points.len()]
    }

    /// `F_k(j)` for every `j`: the best cost of the first `j` points in `k` clusters, by the
    /// plain O(k·n²) DP.
    fn quadratic_dp_rows(points: &[(f64, f64)], k: usize) -> Vec<f64> {
        let pre = Prefix::new(points, 0.0);
        let n = points.len();
        let mut prev: Vec<f64> = (0..=n).map(|j| pre.cost(0, j)).collect();
        for _ in 2..=k {
            let mut cur = vec![f64::INFINITY; n + 1];
            for (j, c) in cur.iter_mut().enumerate().skip(1) {
                *c = (0..j)
                    .map(|i| prev[i] + pre.cost(i, j))
                    .fold(f64::INFINITY, f64::min);
            }
            prev = cur;
        }
        prev
    }

    /// Every row of a half-DP, not just the ones an optimum goes through, is the plain DP's
    /// `F_c(j)`, with and without the cost cut (rows the cut keeps are exact, and every row
    /// the plain DP puts at or below the cut is kept); its splits give partitions of that cost.
    #[test]
    fn half_dp_rows_match_the_quadratic_dp() {
        for (seed, n) in [(11, 3), (12, 9), (13, 40), (14, 131), (15, 400)] {
            let points = weighted_points(seed, n);
            let n = points.len();
            let total_w: f64 = points.iter().map(|p| p.1).sum();
            let shift = points.iter().map(|p| p.0 * p.1).sum::<f64>() / total_w;
            let pre = Prefix::new(&points, shift);
            let tol = DP_REL_TOL * pre.cost(0, n) + 1e-15;
            for layers in 1..=n.min(9) {
                let reference = quadratic_dp_rows(&points, layers);
                let bound = lloyd_upper_bound(&pre, &points, shift, layers);
                for cutoff in [f64::INFINITY, bound] {
                    let half = Half::solve(&pre, layers, cutoff);
                    for (j, &want) in reference.iter().enumerate().skip(layers) {
                        let ours = half.last[j];
                        let at = format!("n={n} layers={layers} cutoff={cutoff} j={j}");
                        if ours.is_finite() || want <= cutoff - tol {
                            assert!((ours - want).abs() <= tol, "{at}: {ours} vs {want}");
                            let b = half.backtrack(j, n);
                            let cost: f64 = b.windows(2).map(|s| pre.cost(s[0], s[1])).sum();
                            assert!((cost - want).abs() <= tol, "{at}: splits cost {cost}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn pruned_dp_matches_quadratic_dp_at_moderate_sizes() {
        let mut rng = crate::SplitMix64(21);
        for (n, k) in [(600, 16), (300, 64), (1000, 4)] {
            let mut xs: Vec<f64> = (0..n).map(|_| (rng.normal() * 0.05) as f64).collect();
            xs.sort_by(f64::total_cmp);
            xs.dedup();
            let points: Vec<(f64, f64)> = xs
                .iter()
                .map(|&x| (x, 1.0 + (rng.next_u64() % 50) as f64))
                .collect();
            let ours = cost_of(&points, &optimal_centers(&points, k));
            let best = quadratic_dp_cost(&points, k);
            // Same optimum, different summation order: f64 rounding only.
            assert!(ours <= best * (1.0 + 1e-9), "n={n} k={k}: {ours} vs {best}");
        }
    }

    /// The previous solver, kept as a reference: recursive divide-and-conquer per layer with the
    /// full segment cost (clamped at 0) and the same Knuth–Yao lower bound.
    fn recursive_dc_cost(points: &[(f64, f64)], k: usize) -> f64 {
        let n = points.len();
        if n <= k {
            return 0.0;
        }
        let total_w: f64 = points.iter().map(|p| p.1).sum();
        let shift = points.iter().map(|p| p.0 * p.1).sum::<f64>() / total_w;
        let pre = Prefix::new(points, shift);
        let mut prev: Vec<f64> = (0..=n).map(|j| pre.cost(0, j)).collect();
        let mut lower = vec![0usize; n + 1];
        for c in 2..=k {
            let mut cur = vec![f64::INFINITY; n + 1];
            let mut split = vec![0usize; n + 1];
            let jlo = if c == k { n } else { c };
            let mut stack = vec![(jlo, n, c - 1, n - 1)];
            while let Some((jlo, jhi, olo, ohi)) = stack.pop() {
                if jlo > jhi {
                    continue;
                }
                let mid = jlo + (jhi - jlo) / 2;
                let hi = ohi.min(mid - 1);
                let lo = olo.max(lower[mid]).min(hi);
                let (mut best, mut arg) = (f64::INFINITY, lo);
                for (i, p) in prev.iter().enumerate().take(hi + 1).skip(lo) {
                    let v = p + pre.cost(i, mid);
                    if v < best {
                        best = v;
                        arg = i;
                    }
                }
                cur[mid] = best;
                split[mid] = arg;
                if mid > jlo {
                    stack.push((jlo, mid - 1, olo, arg));
                }
                stack.push((mid + 1, jhi, arg, ohi));
            }
            prev = cur;
            lower = split;
        }
        prev[n]
    }

    /// Sorted distinct points with positive weights, shaped like real weights: a dense normal
    /// core on an f16 grid (many near-equal costs) plus sparse tails.
    fn weighted_points(seed: u64, n: usize) -> Vec<(f64, f64)> {
        let mut rng = crate::SplitMix64(seed);
        let mut xs: Vec<f64> = (0..n)
            .map(|_| {
                let x = rng.normal() * 0.05;
                let x = if rng.next_u64().is_multiple_of(16) {
                    x * 6.0
                } else {
                    x
                };
                f16::from_f32(x).to_f64()
            })
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs.iter()
            .map(|&x| {
                let w = if rng.next_u64().is_multiple_of(2) {
                    1.0 + (rng.next_u64() % 400) as f64
                } else {
                    0.01 + rng.uniform() as f64
                };
                (x, w)
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The level-order solver reaches the recursive solver's optimum on random weighted
        /// inputs, across the branch-free (< 4 candidates), vector and tail search paths.
        #[test]
        fn level_order_dp_matches_recursive_dp(
            seed in any::<u64>(),
            n in 1usize..3000,
            nbits in prop::sample::select(vec![1u8, 2, 3, 4, 5, 6]),
        ) {
            let k = 1usize << nbits;
            let points = weighted_points(seed, n);
            let ours = cost_of(&points, &optimal_centers(&points, k));
            let reference = recursive_dc_cost(&points, k);
            // Same optimum, different summation order: f64 rounding only.
            // Prefix-sum rounding scales with the total spread, not with the (possibly tiny)
            // optimum: measure the difference against the one-cluster cost.
            let spread = brute_force_cost(&points, 1);
            prop_assert!(
                (ours - reference).abs() <= spread * DP_REL_TOL,
                "n={} k={k}: ours {ours} vs reference {reference}", points.len()
            );
        }
    }

    #[test]
    fn level_order_dp_matches_quadratic_dp_on_real_shaped_inputs() {
        for (seed, n, k) in [(1, 2000, 16), (2, 700, 64), (3, 5000, 4), (4, 257, 256)] {
            let points = weighted_points(seed, n);
            let ours = cost_of(&points, &optimal_centers(&points, k));
            let best = quadratic_dp_cost(&points, k);
            assert!(
                ours <= best * (1.0 + DP_REL_TOL) + 1e-15,
                "n={} k={k}: {ours} vs {best}",
                points.len()
            );
        }
    }

    #[test]
    fn cost_cut_prunes_rows_and_keeps_the_optimum() {
        for (seed, n, k) in [(5, 4000, 16), (6, 3000, 64), (7, 2000, 4)] {
            let points = weighted_points(seed, n);
            let n = points.len();
            let total_w: f64 = points.iter().map(|p| p.1).sum();
            let shift = points.iter().map(|p| p.0 * p.1).sum::<f64>() / total_w;
            let pre = Prefix::new(&points, shift);
            let mirrored: Vec<(f64, f64)> = points.iter().rev().map(|&(x, w)| (-x, w)).collect();
            let pre_rev = Prefix::new(&mirrored, -shift);
            let bound = lloyd_upper_bound(&pre, &points, shift, k);
            let cutoff = bound + CUT_MARGIN * pre.cost(0, n);
            let (front, back) = (k / 2, k - k / 2);
            let (cf, cb, cj) = meet(&pre, &pre_rev, front, back, cutoff).unwrap();
            let (ff, fb, fj) = meet(&pre, &pre_rev, front, back, f64::INFINITY).unwrap();
            let cut = cf.last[cj] + cb.last[n - cj];
            let full = ff.last[fj] + fb.last[n - fj];
            assert!(
                (cut - full).abs() <= DP_REL_TOL * pre.cost(0, n),
                "{cut} vs {full}"
            );
            assert!(
                full <= bound * (1.0 + DP_REL_TOL),
                "Lloyd beat the DP: {bound} < {full}"
            );
            let solved = |h: &Half| h.splits.iter().filter(|&&s| s != UNSOLVED).count();
            assert!(
                solved(&cf) < solved(&ff) && solved(&cb) < solved(&fb),
                "n={n} k={k}: the cut dropped nothing"
            );
        }
    }

    #[test]
    fn constant_tensor_is_exact() {
        let v = vec![f16::from_f32(0.25); 100];
        let p = palettize_f16(&v, 4, None).unwrap();
        assert_eq!(p.lut.len(), 16);
        assert!(p.lut.iter().all(|&x| x == f16::from_f32(0.25)));
        assert!(p.indices.iter().all(|&i| i == 0));
        assert_eq!(p.mse, 0.0);
        assert!(p.snr_db.is_infinite());
    }

    #[test]
    fn few_distinct_values_are_reproduced_exactly() {
        let vals = [-1.5f32, 0.0, -0.0, 2.0, 0.125];
        let v: Vec<f16> = (0..50).map(|i| f16::from_f32(vals[i % 5])).collect();
        let p = palettize_f16(&v, 2, None).unwrap();
        assert_eq!(p.mse, 0.0);
        let back = p.dequantize();
        for (a, b) in v.iter().zip(&back) {
            assert_eq!(a.to_f32(), b.to_f32());
        }
        assert!(p.lut.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn nan_and_inf_are_errors() {
        let mut v = vec![f16::from_f32(0.5); 10];
        v[3] = f16::NAN;
        assert!(matches!(
            palettize_f16(&v, 4, None),
            Err(NumericsError::NonFinite { index: 3, .. })
        ));
        v[3] = f16::NEG_INFINITY;
        assert!(palettize_f16(&v, 4, None).is_err());
    }

    #[test]
    fn bad_weights_and_nbits_are_errors() {
        let v = vec![f16::from_f32(0.5); 4];
        assert!(palettize_f16(&v, 5, None).is_err());
        assert!(palettize_f16(&v, 4, Some(&[1.0, 1.0])).is_err());
        assert!(palettize_f16(&v, 4, Some(&[1.0, -1.0, 1.0, 1.0])).is_err());
        assert!(palettize_f16(&v, 4, Some(&[1.0, f32::NAN, 1.0, 1.0])).is_err());
    }

    #[test]
    fn weights_pull_the_lut_towards_important_values() {
        // Two values, one cluster: the centre is the weighted mean.
        let v = vec![f16::from_f32(0.0), f16::from_f32(1.0)];
        let p = palettize_f16(&v, 1, None).unwrap();
        assert_eq!(p.mse, 0.0);
        let v = vec![f16::from_f32(0.0), f16::from_f32(0.25), f16::from_f32(1.0)];
        let p = palettize_f16(&v, 1, Some(&[1.0, 1.0, 0.0])).unwrap();
        // {0, 0.25} weighted fully, 1.0 ignored by the fit: LUT is {0, 0.25}.
        assert_eq!(p.lut[0].to_f32(), 0.0);
        assert_eq!(p.lut[1].to_f32(), 0.25);
        assert_eq!(p.indices, vec![0, 1, 1]);
    }

    #[test]
    fn empty_input() {
        let p = palettize_f16(&[], 4, None).unwrap();
        assert!(p.indices.is_empty());
        assert_eq!(p.lut.len(), 16);
    }

    /// `dequantize` is `lut[indices]`, element by element, on a fit written by hand.
    #[test]
    fn dequantize_is_lut_of_indices() {
        let [a, b] = [f16::from_f32(-0.5), f16::from_f32(2.0)];
        let fit = LutFit {
            nbits: 1,
            lut: vec![a, b],
            indices: vec![1, 0, 1, 1],
            mse: 0.0,
            snr_db: f64::INFINITY,
        };
        assert_eq!(fit.dequantize(), vec![b, a, b, b]);
    }

    /// A weight-0 element stays out of the LUT even when the LUT has room for it (3 values,
    /// 4 entries): the entries are the two weighted values, the tail repeats the largest. It is
    /// still assigned, to its nearest entry.
    #[test]
    fn zero_weight_values_get_no_entry_of_their_own() {
        let v: Vec<f16> = [0.0f32, 0.25, 1.0].map(f16::from_f32).to_vec();
        let p = palettize_f16(&v, 2, Some(&[1.0, 1.0, 0.0])).unwrap();
        let quarter = f16::from_f32(0.25);
        assert_eq!(p.lut, vec![f16::ZERO, quarter, quarter, quarter]);
        assert_eq!(p.indices, vec![0, 1, 1]);
    }

    /// A value exactly between two entries goes to the lower one: {0, 2} weighted, 1 of weight
    /// 0 at distance 1 from both.
    #[test]
    fn ties_go_to_the_lower_entry() {
        let v: Vec<f16> = [0.0f32, 1.0, 2.0].map(f16::from_f32).to_vec();
        let p = palettize_f16(&v, 1, Some(&[1.0, 0.0, 1.0])).unwrap();
        assert_eq!(p.lut, vec![f16::ZERO, f16::from_f32(2.0)]);
        assert_eq!(p.indices, vec![0, 0, 1]);
        // Unweighted mse: only the middle element is off, by 1.
        assert!((p.mse - 1.0 / 3.0).abs() < 1e-15, "mse {}", p.mse);
    }

    /// −0 and +0 are one value: its weight and count are the sum of both patterns'.
    #[test]
    fn signed_zeros_are_one_value() {
        let zeros = [f16::NEG_ZERO, f16::ZERO];
        // Two distinct values for four entries: one entry for both zeros, then 1 (repeated).
        let v = vec![zeros[0], zeros[1], f16::ONE];
        let p = palettize_f16(&v, 2, None).unwrap();
        assert_eq!(p.indices, vec![0, 0, 1]);
        assert_eq!(p.lut[1..], [f16::ONE; 3]);
        // {0, 0, 1} | {10} (cost 2/3, against 40.5 for {0, 0} | {1, 10}): the first centre is
        // the mean 1/3 only if the zeros weigh 2, and the mse counts both zeros.
        let v = vec![zeros[0], zeros[1], f16::ONE, f16::from_f32(10.0)];
        let p = palettize_f16(&v, 1, None).unwrap();
        let c = f16::from_f64(1.0 / 3.0);
        assert_eq!(p.lut, vec![c, f16::from_f32(10.0)]);
        assert_eq!(p.indices, vec![0, 0, 0, 1]);
        let c = c.to_f64();
        let mse = (2.0 * c * c + (1.0 - c) * (1.0 - c)) / 4.0;
        assert!((p.mse - mse).abs() < 1e-15, "mse {} vs {mse}", p.mse);
    }

    /// Scaling every importance weight by the same factor is the same problem: {16, 17, 20} in
    /// two clusters is {16, 17} | {20} (cost 0.5, against 4.5 for {16} | {17, 20}) at any
    /// uniform weight, so the centres are 16.5 and 20 (exact in f16), also at weights of 1e-30
    /// and 1e30.
    #[test]
    fn uniform_weights_of_any_scale_give_the_unweighted_fit() {
        let v: Vec<f16> = [16.0f32, 17.0, 20.0].map(f16::from_f32).to_vec();
        let lut = vec![f16::from_f32(16.5), f16::from_f32(20.0)];
        for w in [None, Some(1e-30f32), Some(1.0), Some(1e30)] {
            let weights = w.map(|w| vec![w; 3]);
            let p = palettize_f16(&v, 1, weights.as_deref()).unwrap();
            assert_eq!(p.lut, lut, "weights {w:?}");
            assert_eq!(p.indices, vec![0, 0, 1], "weights {w:?}");
        }
    }

    /// Lloyd's bound on a problem solved by hand: {5} | {10, 10.1, …, 10.5} is optimal at two
    /// clusters (cost 0.01·Σ(i − 2.5)² = 0.175). The weighted-quantile start {5, 10, 10.1,
    /// 10.2} | {10.3, 10.4, 10.5} costs 19.5475; one Lloyd step (midpoint 9.6125) moves to the
    /// optimum and the next one keeps it.
    #[test]
    fn lloyd_bound_reaches_the_optimum_from_a_bad_start() {
        let points: Vec<(f64, f64)> = [5.0, 10.0, 10.1, 10.2, 10.3, 10.4, 10.5]
            .map(|x| (x, 1.0))
            .to_vec();
        let shift = points.iter().map(|p| p.0).sum::<f64>() / 7.0;
        let pre = Prefix::new(&points, shift);
        let bound = lloyd_upper_bound(&pre, &points, shift, 2);
        assert!((bound - 0.175).abs() < 1e-12, "bound {bound}");
    }

    /// Equal-cost optima are broken the same way every time: {0, 1, 2} in two clusters costs
    /// 0.5 as {0} | {1, 2} and as {0, 1} | {2} (exactly, in the prefix sums centred on 1); the
    /// first meeting point of the two half-DPs wins, which is {0} | {1, 2}.
    #[test]
    fn equal_cost_partitions_break_ties_to_the_first_split() {
        let v: Vec<f16> = [0.0f32, 1.0, 2.0].map(f16::from_f32).to_vec();
        let p = palettize_f16(&v, 1, None).unwrap();
        assert_eq!(p.lut, vec![f16::ZERO, f16::from_f32(1.5)]);
        assert_eq!(p.indices, vec![0, 1, 1]);
    }

    /// `Rows::min` returns the leftmost of equal minima, on the short path (< 4 candidates),
    /// within a lane, across lanes and in the tail. With `s1` all zero the searched value is
    /// `a[i]` exactly, so the expected index can be read off each row.
    #[test]
    fn rows_min_is_the_leftmost_minimum() {
        let cases: [(&[f64], usize, usize); 8] = [
            (&[1., 1., 1., 1.], 0, 0),
            (&[5., 5., 1., 1.], 0, 2),
            (&[1., 5., 1., 5.], 0, 0),
            (&[5., 5., 1., 5., 5., 5., 5., 1., 5., 5., 5.], 0, 2),
            (&[5., 5., 1., 5., 5., 5., 5., 1., 5., 5., 5.], 1, 2),
            (&[5., 5., 1., 5., 5., 1., 5., 5., 5., 5., 5.], 0, 2),
            (&[5., 5., 5., 1., 5., 5., 5., 1., 5., 5., 5.], 0, 3),
            (&[5., 5., 1., 5., 5., 5., 5., 5., 5., 1., 5.], 0, 2),
        ];
        for (a, lo, want) in cases {
            let w: Vec<f64> = (0..=a.len()).map(|i| i as f64).collect();
            let s1 = vec![0.0; a.len() + 1];
            let rows = Rows { w: &w, s1: &s1, a };
            assert_eq!(
                rows.min(lo, a.len() - 1, a.len()),
                (1.0, want),
                "{a:?} from {lo}"
            );
        }
    }

    /// The reported error figures against a fit solved by hand: {0, 1, 4} in two clusters is
    /// {0, 1} | {4} (cost 0.5, against 4.5 for {0} | {1, 4}), centres 0.5 and 4 (exact in f16),
    /// squared errors 0.25, 0.25, 0: mse 0.5/3, SNR 10·log10(17/0.5).
    #[test]
    fn error_figures_by_hand() {
        let v: Vec<f16> = [0.0f32, 1.0, 4.0].map(f16::from_f32).to_vec();
        let p = palettize_f16(&v, 1, None).unwrap();
        assert_eq!(p.lut, vec![f16::from_f32(0.5), f16::from_f32(4.0)]);
        assert_eq!(p.indices, vec![0, 0, 1]);
        assert!((p.mse - 0.5 / 3.0).abs() < 1e-15, "mse {}", p.mse);
        assert!(
            (p.snr_db - 10.0 * 34f64.log10()).abs() < 1e-12,
            "snr {}",
            p.snr_db
        );
        assert!((snr_db(100.0, 1.0) - 20.0).abs() < 1e-12);
        assert_eq!(snr_db(1.0, 0.0), f64::INFINITY);
    }
}
