//! Device tensors as the aclnn kernels see them: [`DevTensor`], a view (base address,
//! element offset, shape, strides, [`DType`]) of device memory the host cannot read.
//!
//! A view never owns memory: whoever allocated the buffer (the executor's arena, a
//! model's parameter buffers, a [`DeviceBuffer`]) keeps it alive while kernels that
//! read or write the view are queued. Views are cheap to clone and to reshape; the
//! strided ones ([`DevTensor::t`], [`DevTensor::permute`], [`DevTensor::narrow`]) are
//! handed to aclnn as they are (`aclCreateTensor` takes view dims, strides, an offset
//! and the storage dims), and the kernels read them through their strides.
//!
//! Shapes and strides are in elements. The view-building methods whose signatures
//! return a view (not a `Result`) panic on arguments that cannot describe a view of
//! this tensor (a dimension out of range, a range past the end), as slice indexing
//! does; the `try_` variants return a [`TensorError`] instead.

use super::safe::DeviceBuffer;
use super::AscendError;

/// Element type of a device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `float` (`ACL_FLOAT`).
    F32,
    /// `int64_t` (`ACL_INT64`), indices and targets.
    I64,
    /// `bool` (`ACL_BOOL`), one byte, masks.
    Bool,
}

impl DType {
    /// Bytes per element: 4, 8, 1.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }
}

/// Why a view cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// A dimension index past the tensor's rank.
    #[error("dimension {dim} out of range for a {rank}-D tensor")]
    Dim { dim: usize, rank: usize },
    /// `permute`'s argument is not a permutation of `0..rank`.
    #[error(
        "{dims:?} is not a permutation of the {rank} dimensions (list each of 0..{rank} once)"
    )]
    NotPermutation { dims: Vec<usize>, rank: usize },
    /// `narrow` past the end of a dimension.
    #[error("narrow({dim}, {start}, {len}) runs past the dimension's size {size}")]
    Range {
        dim: usize,
        start: usize,
        len: usize,
        size: usize,
    },
}

/// A view of device memory: base device address, element offset from it, shape and
/// strides (in elements), element type. Does not own the memory. Cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DevTensor {
    addr: usize,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `shape`.
fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut s = 1;
    for (st, &d) in strides.iter_mut().zip(shape).rev() {
        *st = s;
        s *= d.max(1);
    }
    strides
}

impl DevTensor {
    /// A contiguous row-major tensor of `shape` at device address `addr` (a 0-D
    /// tensor, `shape` `[]`, is one element).
    pub fn new(addr: usize, dtype: DType, shape: &[usize]) -> DevTensor {
        DevTensor {
            addr,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// A contiguous tensor of `shape` at the start of `buf`, which must hold at least
    /// its bytes (a larger buffer is fine: the view covers its start).
    pub fn of(buf: &DeviceBuffer, dtype: DType, shape: &[usize]) -> Result<DevTensor, AscendError> {
        let need = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| AscendError::Tensor(format!("shape {shape:?} overflows")))?;
        if need > buf.len() {
            return Err(AscendError::Tensor(format!(
                "a {dtype:?} tensor of shape {shape:?} needs {need} bytes but the device buffer \
                 has {} (allocate a larger buffer or view a smaller shape)",
                buf.len()
            )));
        }
        Ok(DevTensor::new(buf.as_ptr() as usize, dtype, shape))
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements (1 for a 0-D tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are laid out row-major without gaps (strides of dimensions
    /// of size 1 do not matter).
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    /// The base device address (of the buffer, not of the first element).
    pub fn base_addr(&self) -> usize {
        self.addr
    }

    /// The element offset of the first element from [`Self::base_addr`].
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The device address of the first element.
    pub fn data_addr(&self) -> usize {
        self.addr + self.offset * self.dtype.size()
    }

    /// Elements from the base address to one past the last element this view reaches
    /// (the storage size `aclCreateTensor` is told; `offset` for an empty view).
    pub fn storage_len(&self) -> usize {
        if self.numel() == 0 {
            return self.offset;
        }
        self.offset
            + 1
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
    }

    /// The view with its last two dimensions swapped (a strided view; 0-D and 1-D
    /// tensors are returned as they are).
    pub fn t(&self) -> DevTensor {
        let n = self.rank();
        if n < 2 {
            return self.clone();
        }
        let mut v = self.clone();
        v.shape.swap(n - 2, n - 1);
        v.strides.swap(n - 2, n - 1);
        v
    }

    /// The view whose dimension `i` is this tensor's dimension `dims[i]`.
    ///
    /// # Panics
    /// When `dims` is not a permutation of `0..rank` ([`Self::try_permute`] does not).
    pub fn permute(&self, dims: &[usize]) -> DevTensor {
        self.try_permute(dims).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::permute`], with an error for a wrong `dims`.
    pub fn try_permute(&self, dims: &[usize]) -> Result<DevTensor, TensorError> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        let ok = dims.len() == rank
            && dims
                .iter()
                .all(|&d| d < rank && !std::mem::replace(&mut seen[d], true));
        if !ok {
            return Err(TensorError::NotPermutation {
                dims: dims.to_vec(),
                rank,
            });
        }
        let mut v = self.clone();
        v.shape = dims.iter().map(|&d| self.shape[d]).collect();
        v.strides = dims.iter().map(|&d| self.strides[d]).collect();
        Ok(v)
    }

    /// The same elements with another shape, for a contiguous view whose element count
    /// matches; `None` otherwise (make it contiguous first with a copy).
    pub fn reshape(&self, shape: &[usize]) -> Option<DevTensor> {
        if !self.is_contiguous() || shape.iter().product::<usize>() != self.numel() {
            return None;
        }
        Some(DevTensor {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            ..self.clone()
        })
    }

    /// Elements `start..start + len` of dimension `dim`.
    ///
    /// # Panics
    /// When `dim` or the range is out of bounds ([`Self::try_narrow`] does not).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> DevTensor {
        self.try_narrow(dim, start, len)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::narrow`], with an error for a wrong dimension or range.
    pub fn try_narrow(
        &self,
        dim: usize,
        start: usize,
        len: usize,
    ) -> Result<DevTensor, TensorError> {
        let rank = self.rank();
        let Some(&size) = self.shape.get(dim) else {
            return Err(TensorError::Dim { dim, rank });
        };
        if start.checked_add(len).is_none_or(|e| e > size) {
            return Err(TensorError::Range {
                dim,
                start,
                len,
                size,
            });
        }
        let mut v = self.clone();
        v.shape[dim] = len;
        if len > 0 {
            v.offset += start * self.strides[dim];
        }
        Ok(v)
    }

    /// A 1-D view of a contiguous tensor; `None` for a strided one.
    pub fn flat(&self) -> Option<DevTensor> {
        self.reshape(&[self.numel()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element offsets (from the base) of every element, in row-major index order.
    fn offsets(t: &DevTensor) -> Vec<usize> {
        let n = t.numel();
        (0..n)
            .map(|mut i| {
                let mut off = t.offset();
                for (&d, &s) in t.shape().iter().zip(t.strides()).rev() {
                    off += (i % d) * s;
                    i /= d;
                }
                off
            })
            .collect()
    }

    #[test]
    fn contiguous_new() {
        let t = DevTensor::new(0x1000, DType::F32, &[2, 3, 4]);
        assert_eq!(t.strides(), &[12, 4, 1]);
        assert_eq!(t.numel(), 24);
        assert!(t.is_contiguous());
        assert_eq!(t.storage_len(), 24);
        assert_eq!(offsets(&t), (0..24).collect::<Vec<_>>());
        let s = DevTensor::new(0x1000, DType::I64, &[]);
        assert_eq!(s.numel(), 1);
        assert!(s.is_contiguous());
        assert_eq!(s.storage_len(), 1);
        assert_eq!(DType::F32.size(), 4);
        assert_eq!(DType::I64.size(), 8);
        assert_eq!(DType::Bool.size(), 1);
    }

    #[test]
    fn transpose_is_a_strided_view() {
        let a = DevTensor::new(64, DType::F32, &[2, 3]);
        let t = a.t();
        assert_eq!(t.shape(), &[3, 2]);
        assert_eq!(t.strides(), &[1, 3]);
        assert!(!t.is_contiguous());
        // Element (i, j) of the transpose is element (j, i) of the original.
        assert_eq!(offsets(&t), vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(t.t(), a);
        assert_eq!(t.reshape(&[6]), None);
        assert_eq!(t.flat(), None);
        let b = DevTensor::new(64, DType::F32, &[4, 2, 3]).t();
        assert_eq!(b.shape(), &[4, 3, 2]);
        assert_eq!(b.strides(), &[6, 1, 3]);
        let v = DevTensor::new(64, DType::F32, &[5]);
        assert_eq!(v.t(), v);
    }

    #[test]
    fn permute_matches_index_mapping() {
        let a = DevTensor::new(0, DType::F32, &[2, 3, 4]);
        let p = a.permute(&[2, 0, 1]);
        assert_eq!(p.shape(), &[4, 2, 3]);
        let off = offsets(&p);
        for k in 0..4 {
            for i in 0..2 {
                for j in 0..3 {
                    assert_eq!(off[(k * 2 + i) * 3 + j], i * 12 + j * 4 + k);
                }
            }
        }
        assert_eq!(a.permute(&[0, 1, 2]), a);
        assert!(a.try_permute(&[0, 0, 1]).is_err());
        assert!(a.try_permute(&[0, 1]).is_err());
        assert!(a.try_permute(&[0, 1, 3]).is_err());
    }

    #[test]
    fn reshape_and_flat_of_contiguous() {
        let a = DevTensor::new(0, DType::F32, &[2, 3, 4]);
        let r = a.reshape(&[6, 4]).unwrap();
        assert_eq!(r.strides(), &[4, 1]);
        assert_eq!(offsets(&r), offsets(&a));
        assert_eq!(a.reshape(&[5, 5]), None);
        assert_eq!(a.flat().unwrap().shape(), &[24]);
        // A narrowed leading dimension stays contiguous, with an offset.
        let n = a.narrow(0, 1, 1);
        assert!(n.is_contiguous());
        let f = n.flat().unwrap();
        assert_eq!(f.offset(), 12);
        assert_eq!(offsets(&f), (12..24).collect::<Vec<_>>());
    }

    #[test]
    fn narrow_offsets_and_bounds() {
        let a = DevTensor::new(0x200, DType::F32, &[3, 5]);
        let n = a.narrow(1, 2, 3);
        assert_eq!(n.shape(), &[3, 3]);
        assert_eq!(n.offset(), 2);
        assert_eq!(n.data_addr(), 0x200 + 8);
        assert!(!n.is_contiguous());
        assert_eq!(offsets(&n), vec![2, 3, 4, 7, 8, 9, 12, 13, 14]);
        assert_eq!(n.storage_len(), 15);
        assert_eq!(
            a.try_narrow(1, 4, 2),
            Err(TensorError::Range {
                dim: 1,
                start: 4,
                len: 2,
                size: 5
            })
        );
        assert_eq!(
            a.try_narrow(2, 0, 1),
            Err(TensorError::Dim { dim: 2, rank: 2 })
        );
        assert_eq!(a.narrow(0, 3, 0).numel(), 0);
    }

    #[test]
    fn of_checks_the_buffer_size() {
        let buf = DeviceBuffer::new(24).unwrap();
        let t = DevTensor::of(&buf, DType::F32, &[2, 3]).unwrap();
        assert_eq!(t.base_addr(), buf.as_ptr() as usize);
        assert!(DevTensor::of(&buf, DType::F32, &[2, 2]).is_ok());
        let e = DevTensor::of(&buf, DType::I64, &[2, 3]).unwrap_err();
        assert!(matches!(e, AscendError::Tensor(_)), "{e}");
        assert!(e.to_string().contains("48 bytes"), "{e}");
        assert!(DevTensor::of(&buf, DType::F32, &[usize::MAX, 2]).is_err());
    }

    #[test]
    #[should_panic(expected = "not a permutation")]
    fn permute_panics_on_bad_dims() {
        DevTensor::new(0, DType::F32, &[2, 3]).permute(&[1, 1]);
    }
}
