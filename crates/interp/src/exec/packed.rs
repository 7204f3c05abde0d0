//! Weights that stay in the memory-mapped weight.bin (docs/design.md, "The runner's memory").
//!
//! fp16 constants and LUT-palettized weights (iOS17: one table; iOS18: one table per run of
//! rows, optionally followed by a per-row `constexpr_blockwise_shift_scale`) are not decoded
//! when the program loads: `linear`, 1×1 `conv` and `gather` along axis 0 read them a block of
//! rows at a time, decoded exactly as the constexpr ops decode them (the same table values,
//! the same `scale · (value − offset)` in f32, the same rounding to fp16) and fed to the same
//! dot products, so every result is bit for bit the one the dense weight gives. A weight any
//! other op reads is decoded whole when the program loads.

use std::sync::Arc;

use half::f16;
use rayon::prelude::*;

use super::kernels::{
    dot, dot_f16, dot_lut_f16, gemm_nt, gemm_nt_f16, unpack, unpack_f16, LutTable, Table,
};
use super::ops::{self, Args, OpResult};
use super::tensor::{Data, Tensor};
use crate::mil::DType;
use crate::mlpackage::BlobFile;

/// Output rows decoded at once by one thread.
const BLOCK: usize = 32;

/// How the bytes of a packed weight encode its values.
#[derive(Debug, Clone, PartialEq)]
pub enum Form {
    /// fp16 values, little-endian.
    Half,
    /// `nbits`-bit indices packed LSB-first into tables of `2^nbits` entries.
    Lut(Lut),
}

/// A LUT-palettized weight: table `r / rows_per_table` serves row `r`.
#[derive(Debug, Clone, PartialEq)]
pub struct Lut {
    pub nbits: u32,
    /// The tables, one after the other, `2^nbits` values each.
    pub tables: Vec<f32>,
    pub rows_per_table: usize,
    /// Per row, `(scale, offset)`: the value is `scale · (entry − offset)`.
    pub scale: Option<Vec<(f32, f32)>>,
}

/// One weight left in its weight file.
#[derive(Debug, Clone)]
pub struct Packed {
    pub(crate) file: Arc<BlobFile>,
    pub(crate) offset: u64,
    /// The dtype the program computes it in (fp16 rows feed the fp16 dot product).
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub form: Form,
    /// The dense loader would store it as fp16 (it is also a `linear`/`conv` weight), so
    /// the rows `gather` reads are rounded to fp16 as they were (a scaled LUT's values are
    /// not all fp16 before that).
    pub gathers_half: bool,
}

impl Packed {
    /// A weight of `shape` whose bytes are the blob at `offset` of `file`, or `None` when the
    /// blob does not hold what `form` needs (the dense decoder then reports the problem).
    pub fn new(
        file: Arc<BlobFile>,
        offset: u64,
        dtype: DType,
        shape: Vec<usize>,
        form: Form,
    ) -> Option<Self> {
        let numel = crate::mlpackage::element_count(&shape)?;
        let rows = *shape.first()?;
        if rows == 0 || numel == 0 || !dtype.is_float() {
            return None;
        }
        let rec = file.record(offset).ok()?;
        let ok = match &form {
            Form::Half => rec.dtype == DType::F16 && rec.data.len() == numel.checked_mul(2)?,
            Form::Lut(l) => {
                let entries = 1usize << l.nbits;
                let tables = rows.checked_div(l.rows_per_table)?;
                (1..=8).contains(&l.nbits)
                    && rows % l.rows_per_table == 0
                    && l.tables.len() == tables.checked_mul(entries)?
                    && l.scale.as_ref().is_none_or(|s| s.len() == rows)
                    && rec.data.len() >= numel.checked_mul(l.nbits as usize)?.div_ceil(8)
            }
        };
        ok.then_some(Packed {
            file,
            offset,
            dtype,
            shape,
            form,
            gathers_half: false,
        })
    }

    pub fn rows(&self) -> usize {
        self.shape[0]
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// Bytes the dense weight takes once decoded (f32 values).
    pub fn dense_bytes(&self) -> u64 {
        (self.rows() as u64).saturating_mul(self.cols() as u64) * 4
    }

    /// The blob's bytes as the weight file holds them.
    pub fn blob(&self) -> Result<&[u8], crate::mlpackage::PackageError> {
        self.file.record(self.offset).map(|r| r.data)
    }

    /// The blob's bytes (checked when the weight was made; the map does not change).
    fn bytes(&self) -> OpResult<&[u8]> {
        self.file
            .record(self.offset)
            .map(|r| r.data)
            .map_err(|e| e.to_string().into())
    }

    /// Rows `r0..r1` as f32 into `out` (cleared first).
    fn rows_f32(&self, data: &[u8], r0: usize, r1: usize, out: &mut Vec<f32>) {
        let cols = self.cols();
        out.clear();
        match &self.form {
            Form::Half => {
                let b = &data[r0 * cols * 2..r1 * cols * 2];
                out.extend(
                    b.chunks_exact(2)
                        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
                );
            }
            Form::Lut(l) => {
                out.resize((r1 - r0) * cols, 0.0);
                let mut t = RowTable::new();
                for (r, o) in (r0..r1).zip(out.chunks_exact_mut(cols.max(1))) {
                    l.fill_table(r, &mut t);
                    unpack(data, r * cols, l.nbits, &t.f32, o);
                }
            }
        }
    }

    /// Row `r` as fp16: borrowed from the map when it holds it as it is, else decoded into
    /// `s.half` with the rounding the dense weight had.
    fn row_f16<'a>(&self, data: &'a [u8], r: usize, s: &'a mut Scratch) -> &'a [f16] {
        let cols = self.cols();
        match (&self.form, as_f16(data)) {
            (Form::Half, Some(all)) => &all[r * cols..(r + 1) * cols],
            (Form::Half, None) => {
                s.half.clear();
                let b = &data[r * cols * 2..(r + 1) * cols * 2];
                s.half
                    .extend(b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])));
                &s.half
            }
            (Form::Lut(l), _) => {
                l.fill_table(r, &mut s.table);
                s.half.resize(cols, f16::ZERO);
                unpack_f16(data, r * cols, l.nbits, &s.table.f16, &mut s.half);
                &s.half
            }
        }
    }

    /// Row `r` as f32, decoded into `s.full`.
    fn row_f32<'a>(&self, data: &[u8], r: usize, s: &'a mut Scratch) -> &'a [f32] {
        match &self.form {
            Form::Lut(l) => {
                l.fill_table(r, &mut s.table);
                s.full.resize(self.cols(), 0.0);
                unpack(data, r * self.cols(), l.nbits, &s.table.f32, &mut s.full);
            }
            Form::Half => self.rows_f32(data, r, r + 1, &mut s.full),
        }
        &s.full
    }

    /// Elements `at..at + len` (row-major, flattened) into `out` (cleared first), decoded as
    /// [`Packed::dense`] decodes them: only the rows the range covers are decoded.
    pub fn read_range(&self, at: usize, len: usize, out: &mut Vec<f32>) -> OpResult<()> {
        let cols = self.cols().max(1);
        let end = at
            .checked_add(len)
            .filter(|&e| e <= self.rows() * cols)
            .ok_or_else(|| format!("elements {at}..+{len} of a weight {:?}", self.shape))?;
        let (r0, r1) = (at / cols, end.div_ceil(cols));
        let mut rows = Vec::new();
        self.rows_f32(self.bytes()?, r0, r1, &mut rows);
        let skip = at - r0 * cols;
        out.clear();
        out.extend_from_slice(&rows[skip..skip + len]);
        Ok(())
    }

    /// The whole weight, decoded as the dense constexpr decoders decode it.
    pub fn dense(&self) -> OpResult<Tensor> {
        let mut v = Vec::new();
        self.rows_f32(self.bytes()?, 0, self.rows(), &mut v);
        Ok(Tensor::new(self.dtype, self.shape.clone(), Data::F(v)))
    }

    /// `x @ wᵀ + bias` for every row of `xv` (`ic` values each), output-major [oc, rows], as
    /// `ops::gemv_rows` computes it over the dense weight.
    pub fn gemv(
        &self,
        xv: &[f32],
        bias: Option<&[f32]>,
        oc: usize,
        ic: usize,
    ) -> OpResult<Vec<f32>> {
        if oc != self.rows() || ic != self.cols() {
            return Err(format!("weight {:?} for {oc}×{ic}", self.shape).into());
        }
        let data = self.bytes()?;
        let rows = xv.len() / ic.max(1);
        let mut t = vec![0f32; oc * rows];
        if t.is_empty() {
            return Ok(t);
        }
        // Each weight row is decoded once per call, into a buffer that stays in cache, and
        // multiplied with every row of x there (the dense kernel's loop order and dots: one
        // row of x takes a dot product per weight row, several the blocked product over the
        // block's decoded rows).
        t.par_chunks_mut(BLOCK * rows).enumerate().for_each_init(
            Scratch::default,
            |s, (blk, chunk)| {
                let o0 = blk * BLOCK;
                if rows > 1 {
                    self.block_product(data, o0, xv, ic, s, chunk);
                } else {
                    for (o, out) in (o0..oc).zip(chunk.chunks_exact_mut(rows)) {
                        self.row_dots(data, o, xv, ic, s, out);
                    }
                }
                for (o, out) in (o0..oc).zip(chunk.chunks_exact_mut(rows)) {
                    let b = bias.map_or(0.0, |b| b[o]);
                    out.iter_mut().for_each(|y| *y += b);
                }
            },
        );
        Ok(t)
    }

    /// The weight rows `o0..` of one output block (`out` holds rows(x) values per weight
    /// row), decoded into one tile and multiplied by every row of x with the blocked product,
    /// as `ops::gemv_rows` multiplies the dense weight's rows.
    fn block_product(
        &self,
        data: &[u8],
        o0: usize,
        xv: &[f32],
        ic: usize,
        s: &mut Scratch,
        out: &mut [f32],
    ) {
        let rows = xv.len() / ic.max(1);
        let n = out.len() / rows.max(1);
        if self.dtype == DType::F16 {
            let mut tile = std::mem::take(&mut s.tile_f16);
            tile.clear();
            for o in o0..o0 + n {
                tile.extend_from_slice(self.row_f16(data, o, s));
            }
            gemm_nt_f16(xv, rows, &tile, n, ic, out);
            s.tile_f16 = tile;
        } else {
            let mut tile = std::mem::take(&mut s.tile_f32);
            tile.clear();
            for o in o0..o0 + n {
                tile.extend_from_slice(self.row_f32(data, o, s));
            }
            gemm_nt(xv, rows, &tile, n, ic, out);
            s.tile_f32 = tile;
        }
    }

    /// `out[r] = x_r · w_o` for every row `x_r` of `xv`, as the dense kernel computes it
    /// (fp16 rows with `dot_f16`, f32 rows with `dot`); a single row of x and a LUT row are
    /// looked up as they are multiplied.
    fn row_dots(
        &self,
        data: &[u8],
        o: usize,
        xv: &[f32],
        ic: usize,
        s: &mut Scratch,
        out: &mut [f32],
    ) {
        let xs = xv.chunks_exact(ic.max(1));
        match (&self.form, self.dtype == DType::F16) {
            (Form::Lut(l), true) if out.len() == 1 => {
                l.fill_table(o, &mut s.table);
                out[0] = dot_lut_f16(xv, data, o * ic, l.nbits, &s.table.lut, &mut s.full);
            }
            (_, true) => {
                let w = self.row_f16(data, o, s);
                out.iter_mut().zip(xs).for_each(|(y, x)| *y = dot_f16(x, w));
            }
            (_, false) => {
                let w = self.row_f32(data, o, s);
                out.iter_mut().zip(xs).for_each(|(y, x)| *y = dot(x, w));
            }
        }
    }

    /// Rows `idx` (already in range), one after the other.
    fn gather_rows(&self, idx: &[usize]) -> OpResult<Vec<f32>> {
        let data = self.bytes()?;
        let mut out = Vec::with_capacity(idx.len() * self.cols());
        let mut row = Vec::new();
        for &j in idx {
            self.rows_f32(data, j, j + 1, &mut row);
            out.extend_from_slice(&row);
        }
        if self.gathers_half {
            super::tensor::round_to_f16(&mut out);
        }
        Ok(out)
    }
}

/// A row's table as the dense weight holds its values: scaled, and as fp16 for the fp16
/// kernel (prepared for the LUT product in `lut`); `key` names the table (or the row, when
/// rows are scaled) it was made for.
#[derive(Clone)]
struct RowTable {
    key: Option<usize>,
    f32: Table<f32>,
    f16: Table<f16>,
    lut: LutTable,
}

impl RowTable {
    fn new() -> Self {
        let f16 = [f16::ZERO; 256];
        RowTable {
            key: None,
            f32: [0.0; 256],
            lut: LutTable::new(&f16, 0),
            f16,
        }
    }
}

/// One thread's buffers for [`Packed::gemv`]: the row's table and the decoded row.
struct Scratch {
    table: RowTable,
    half: Vec<f16>,
    full: Vec<f32>,
    /// A block's decoded rows, for the blocked product.
    tile_f16: Vec<f16>,
    tile_f32: Vec<f32>,
}

impl Default for Scratch {
    fn default() -> Self {
        Scratch {
            table: RowTable::new(),
            half: Vec::new(),
            full: Vec::new(),
            tile_f16: Vec::new(),
            tile_f32: Vec::new(),
        }
    }
}

impl Lut {
    /// Make `t` the table of row `r` (unless it already is): `scale · (entry − offset)` in
    /// f32, as `constexpr_blockwise_shift_scale` computes it, and rounded to fp16.
    fn fill_table(&self, r: usize, t: &mut RowTable) {
        let group = r / self.rows_per_table;
        let key = if self.scale.is_some() { r } else { group };
        if t.key == Some(key) {
            return;
        }
        let entries = 1usize << self.nbits;
        let table = &self.tables[group * entries..][..entries];
        let (scale, offset) = self
            .scale
            .as_ref()
            .map_or((None, 0.0), |s| (Some(s[r].0), s[r].1));
        for (i, &v) in table.iter().enumerate() {
            let v = match scale {
                Some(s) => s * (v - offset),
                None => v,
            };
            t.f32[i] = v;
            t.f16[i] = f16::from_f32(v);
        }
        t.lut.set(&t.f16, entries);
        t.key = Some(key);
    }
}

/// The map's bytes as fp16 values, when aligned for them on a little-endian machine.
fn as_f16(data: &[u8]) -> Option<&[f16]> {
    if cfg!(target_endian = "big")
        || !(data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f16>())
    {
        return None;
    }
    // SAFETY: the pointer is aligned for f16 (checked above), the length is whole values,
    // every bit pattern is a valid f16, and the bytes are little-endian like the machine.
    Some(unsafe { std::slice::from_raw_parts(data.as_ptr() as *const f16, data.len() / 2) })
}

/// Refuse a product of `x` with `w` larger than the declared output (what
/// [`super::limits::guard`] checks when the weight is an argument).
fn check_product(args: &Args, w: &Packed) -> OpResult<()> {
    let rows = args.get("x")?.len() / w.cols().max(1);
    super::limits::check_elements(rows as u64 * w.rows() as u64, args)
}

/// MIL `linear` with a packed weight.
pub fn linear(args: &Args, w: &Packed) -> OpResult<Tensor> {
    check_product(args, w)?;
    ops::linear_with(args, &w.shape, |xv, bias, oc, ic| w.gemv(xv, bias, oc, ic))
}

/// MIL `conv` (1×1) with a packed weight.
pub fn conv(args: &Args, w: &Packed) -> OpResult<Tensor> {
    check_product(args, w)?;
    ops::conv_with(args, &w.shape, |xv, bias, oc, ic| w.gemv(xv, bias, oc, ic))
}

/// MIL `gather` along axis 0 of a packed weight (`x`).
pub fn gather(args: &Args, w: &Packed) -> OpResult<Tensor> {
    if args.int_or("axis", 0)? != 0 || args.int_or("batch_dims", 0)? != 0 {
        return Err("a packed weight is gathered along axis 0 only".into());
    }
    let ind = args.get("indices")?;
    let n = w.rows();
    let idx = ops::gather_indices(&ind.as_i64(), n, 0)?;
    let mut shape = ind.shape.clone();
    shape.extend_from_slice(&w.shape[1..]);
    super::limits::check_elements(idx.len() as u64 * w.cols() as u64, args)?;
    Ok(Tensor::new(w.dtype, shape, Data::F(w.gather_rows(&idx)?)))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::tensor;
    use super::*;
    use crate::compile::constexpr::{ios17, ios18};
    use crate::mlpackage::{pack_bits, BlobWriter, TensorTypeInfo, Values};

    /// A weight file holding `blobs`, mapped; the offsets in order.
    fn blob_file(blobs: &[(DType, Vec<u8>)]) -> (tempfile::TempDir, Arc<BlobFile>, Vec<u64>) {
        let mut w = BlobWriter::new();
        let offsets = blobs.iter().map(|(d, b)| w.push(*d, b)).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weight.bin");
        std::fs::write(&path, w.finish()).unwrap();
        let file = Arc::new(BlobFile::open(&path).unwrap());
        (dir, file, offsets)
    }

    /// Deterministic values exact in fp16, of both signs.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| f16::from_f32(((i * 37 + seed * 11) % 97) as f32 / 13.0 - 3.5).to_f32())
            .collect()
    }

    fn indices(n: usize, nbits: u32) -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 7 + i / 5) % (1 << nbits)) as u32)
            .collect()
    }

    /// What `Program::load` makes of a dense fp16 weight read by `linear` (fp16 storage).
    fn as_linear_weight(t: Tensor) -> Tensor {
        if t.dtype != DType::F16 {
            return t;
        }
        let half = tensor::f32_to_half(&t.as_f32());
        Tensor::new(DType::F16, t.shape.clone(), Data::Half(half))
    }

    fn args<'a>(map: &[(&'a str, &'a Tensor)], out: &'a [TensorTypeInfo]) -> Args<'a> {
        Args {
            map: map
                .iter()
                .map(|(k, t)| (*k, vec![*t]))
                .collect::<HashMap<_, _>>(),
            outputs: out,
        }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.as_f32().iter().map(|v| v.to_bits()).collect()
    }

    /// `linear` (x of `rows` rows, with a bias) and `gather` over the packed weight give the
    /// bits the dense weight gives.
    fn assert_same(dense: Tensor, p: &Packed, rows: usize) {
        let (oc, ic) = (p.rows(), p.cols());
        assert_eq!(bits(&p.dense().unwrap()), bits(&dense), "decoded weight");
        assert_gather(dense.clone(), p);
        let dense = as_linear_weight(dense);
        let x = Tensor::f32(vec![1, rows, ic], values(rows * ic, 3));
        let b = Tensor::f32(vec![oc], values(oc, 5));
        let out = [TensorTypeInfo {
            dtype: DType::F32,
            shape: vec![1, rows, oc],
        }];
        let want = ops::linear(&args(&[("x", &x), ("weight", &dense), ("bias", &b)], &out));
        let got = linear(&args(&[("x", &x), ("bias", &b)], &out), p).unwrap();
        assert_eq!(
            bits(&got),
            bits(&want.unwrap()),
            "linear {oc}×{ic}, {rows} rows"
        );
        let also_linear = Packed {
            gathers_half: p.dtype == DType::F16,
            ..p.clone()
        };
        assert_gather(dense, &also_linear);
    }

    /// `gather` along axis 0 of the packed weight gives the bits of `gather` over the dense
    /// weight as the loader stores it.
    fn assert_gather(dense: Tensor, p: &Packed) {
        let ind = Tensor::i32(vec![3], &[0, p.rows() as i32 - 1, -2]);
        let ic = p.cols();
        let out = [TensorTypeInfo {
            dtype: p.dtype,
            shape: vec![3, ic],
        }];
        let want = ops::gather(&args(&[("x", &dense), ("indices", &ind)], &out)).unwrap();
        let got = gather(&args(&[("indices", &ind)], &out), p).unwrap();
        assert_eq!(
            (bits(&got), &got.shape),
            (bits(&want), &want.shape),
            "gather"
        );
    }

    #[test]
    fn ios17_luts_give_the_dense_results_bit_for_bit() {
        // Odd shapes: rows not a multiple of the block, rows whose indices straddle bytes.
        for (nbits, oc, ic) in [
            (4, 37, 13),
            (1, 33, 7),
            (2, 5, 9),
            (3, 40, 11),
            (6, 3, 5),
            (8, 65, 3),
        ] {
            let n = oc * ic;
            let table: Vec<f32> = values(1 << nbits, nbits as usize);
            let lut_bytes: Vec<u8> = table
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect();
            let packed = pack_bits(&indices(n, nbits), nbits);
            let (_d, file, off) = blob_file(&[(DType::U8, packed.clone())]);
            let ty = TensorTypeInfo {
                dtype: DType::F16,
                shape: vec![oc, ic],
            };
            let mk = |v: Vec<i64>, d: DType, s: Vec<usize>| crate::mlpackage::TensorData {
                dtype: d,
                shape: s,
                values: Values::Int(v),
            };
            let idx = mk(
                packed.iter().map(|&b| b as i64).collect(),
                DType::U8,
                vec![packed.len()],
            );
            let shape = mk(vec![oc as i64, ic as i64], DType::U32, vec![2]);
            let lut = crate::mlpackage::TensorData {
                dtype: DType::F16,
                shape: vec![table.len()],
                values: crate::mlpackage::decode_raw(DType::F16, &lut_bytes, table.len()).unwrap(),
            };
            let dense = ios17::lut_to_dense(idx, lut, shape, &ty).unwrap();
            let form = Form::Lut(Lut {
                nbits,
                tables: table,
                rows_per_table: oc,
                scale: None,
            });
            for dtype in [DType::F16, DType::F32] {
                let p =
                    Packed::new(file.clone(), off[0], dtype, vec![oc, ic], form.clone()).unwrap();
                let d = Tensor::new(dtype, dense.shape.clone(), dense.data.clone());
                for rows in [1, 3, 64] {
                    assert_same(d.clone(), &p, rows);
                }
            }
        }
    }

    #[test]
    fn ios18_grouped_luts_and_row_scales_give_the_dense_results_bit_for_bit() {
        for (nbits, oc, ic, groups, scales) in [
            (4, 36, 13, 4, 36),
            (3, 70, 5, 2, 35),
            (2, 6, 3, 3, 1),
            (1, 9, 17, 3, 9),
            (6, 66, 7, 2, 66),
            (8, 40, 5, 1, 4),
        ] {
            let n = oc * ic;
            let idx_dtype = match nbits {
                1 => DType::U1,
                2 => DType::U2,
                3 => DType::U3,
                4 => DType::U4,
                6 => DType::U6,
                _ => DType::U8,
            };
            let raw = indices(n, nbits);
            let (_d, file, off) = blob_file(&[(idx_dtype, pack_bits(&raw, nbits))]);
            let idx = Tensor::new(
                idx_dtype,
                vec![oc, ic],
                Data::I(raw.iter().map(|&i| i as i64).collect()),
            );
            let tables = values(groups << nbits, 9);
            let lut = Tensor::new(
                DType::F16,
                vec![groups, 1, 1 << nbits, 1],
                Data::F(tables.clone()),
            );
            let ty = TensorTypeInfo {
                dtype: DType::F16,
                shape: vec![oc, ic],
            };
            let lut_dense = ios18::lut_to_dense(&idx, &lut, None, &ty).unwrap();
            let scale = Tensor::new(DType::F16, vec![scales, 1], Data::F(values(scales, 2)));
            let offset = Tensor::new(DType::F16, vec![scales, 1], Data::F(values(scales, 4)));
            let dense = ios18::shift_scale(&lut_dense, &scale, Some(&offset), &ty).unwrap();
            let block = oc / scales;
            let (s, o) = (scale.as_f32(), offset.as_f32());
            let lut = Lut {
                nbits,
                tables,
                rows_per_table: oc / groups,
                scale: None,
            };
            let p = Packed::new(
                file.clone(),
                off[0],
                DType::F16,
                vec![oc, ic],
                Form::Lut(lut.clone()),
            )
            .unwrap();
            assert_same(lut_dense, &p, 2);
            let scaled = Lut {
                scale: Some((0..oc).map(|r| (s[r / block], o[r / block])).collect()),
                ..lut
            };
            let p = Packed::new(
                file.clone(),
                off[0],
                DType::F16,
                vec![oc, ic],
                Form::Lut(scaled),
            )
            .unwrap();
            // One row (a decode step) and a prefill's 64 rows, each weight row decoded once.
            for rows in [1, 64] {
                assert_same(dense.clone(), &p, rows);
            }
        }
    }

    #[test]
    fn fp16_weights_are_read_in_place_bit_for_bit() {
        let (oc, ic) = (35, 9);
        let v = values(oc * ic, 1);
        let raw: Vec<u8> = v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect();
        let (_d, file, off) = blob_file(&[(DType::F16, raw.clone())]);
        let dense = Tensor::new(DType::F16, vec![oc, ic], Data::F(v));
        let p = Packed::new(file.clone(), off[0], DType::F16, vec![oc, ic], Form::Half).unwrap();
        assert!(
            as_f16(p.bytes().unwrap()).is_some(),
            "64-byte aligned blobs are borrowed"
        );
        assert_same(dense, &p, 4);
        // A blob of the wrong size or dtype is left to the dense decoder.
        assert!(Packed::new(
            file.clone(),
            off[0],
            DType::F16,
            vec![oc, ic + 1],
            Form::Half
        )
        .is_none());
        let (_d2, file2, off2) = blob_file(&[(DType::U8, raw)]);
        assert!(Packed::new(file2, off2[0], DType::F16, vec![oc, ic], Form::Half).is_none());
    }

    #[test]
    fn conv_with_a_packed_weight_matches_the_dense_kernel() {
        let (oc, ic, pos) = (34, 6, 5);
        let raw = indices(oc * ic, 4);
        let (_d, file, off) = blob_file(&[(DType::U4, pack_bits(&raw, 4))]);
        let table = values(16, 7);
        let lut = Lut {
            nbits: 4,
            tables: table.clone(),
            rows_per_table: oc,
            scale: None,
        };
        let p = Packed::new(file, off[0], DType::F16, vec![oc, ic, 1, 1], Form::Lut(lut)).unwrap();
        let dense: Vec<f32> = raw.iter().map(|&i| table[i as usize]).collect();
        let dense = as_linear_weight(Tensor::new(DType::F16, vec![oc, ic, 1, 1], Data::F(dense)));
        let x = Tensor::f32(vec![1, ic, 1, pos], values(ic * pos, 8));
        let out = [TensorTypeInfo {
            dtype: DType::F32,
            shape: vec![1, oc, 1, pos],
        }];
        let want = ops::conv(&args(&[("x", &x), ("weight", &dense)], &out)).unwrap();
        let got = conv(&args(&[("x", &x)], &out), &p).unwrap();
        assert_eq!(bits(&got), bits(&want));
        // The declared output bounds the product before it is computed.
        let small = [TensorTypeInfo {
            dtype: DType::F32,
            shape: vec![1, oc, 1, 1],
        }];
        let err = conv(&args(&[("x", &x)], &small), &p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("refused before allocating"), "{err}");
    }
}
