//! Safe wrappers over `matrixmultiply`'s `sgemm`/`dgemm`: every matrix product of the
//! model goes through [`gemm`], which checks that each strided view stays inside its
//! slice.

use crate::float::Float;

/// A strided, read-only view of an `rows x cols` matrix inside a slice: element
/// `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct View<'a, F> {
    pub data: &'a [F],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, F> View<'a, F> {
    /// A row-major matrix with `cols` columns.
    pub fn rm(data: &'a [F], cols: usize) -> View<'a, F> {
        View {
            data,
            rs: cols,
            cs: 1,
        }
    }
    /// The transpose of a row-major matrix with `cols` columns.
    pub fn rm_t(data: &'a [F], cols: usize) -> View<'a, F> {
        View {
            data,
            rs: 1,
            cs: cols,
        }
    }
    /// A view with explicit strides.
    pub fn strided(data: &'a [F], rs: usize, cs: usize) -> View<'a, F> {
        View { data, rs, cs }
    }
}

/// The last element index an `rows x cols` view with strides `rs, cs` touches.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    (rows - 1) * rs + (cols - 1) * cs
}

/// `C = beta * C + alpha * A * B` with `A` `m x k`, `B` `k x n` and `C` `m x n` (row
/// stride `rsc`, column stride `csc` into `c`). With `beta == 0`, `C`'s prior content
/// is ignored.
///
/// # Panics
/// If a view reaches past its slice.
#[allow(clippy::too_many_arguments)]
pub fn gemm<F: Float>(
    m: usize,
    k: usize,
    n: usize,
    alpha: F,
    a: View<'_, F>,
    b: View<'_, F>,
    beta: F,
    c: &mut [F],
    rsc: usize,
    csc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(extent(m, n, rsc, csc) < c.len(), "gemm: C out of bounds");
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let x = &mut c[i * rsc + j * csc];
                *x = if beta == F::ZERO { F::ZERO } else { beta * *x };
            }
        }
        return;
    }
    assert!(
        extent(m, k, a.rs, a.cs) < a.data.len(),
        "gemm: A out of bounds"
    );
    assert!(
        extent(k, n, b.rs, b.cs) < b.data.len(),
        "gemm: B out of bounds"
    );
    let s = |x: usize| x as isize;
    // SAFETY: the asserts above keep every element the three views address inside
    // their slices; `c` is borrowed mutably, so it aliases neither `a` nor `b`.
    unsafe {
        F::gemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            s(a.rs),
            s(a.cs),
            b.data.as_ptr(),
            s(b.rs),
            s(b.cs),
            beta,
            c.as_mut_ptr(),
            s(rsc),
            s(csc),
        );
    }
}

/// `C (m x n) = beta * C + A (m x k) * B (k x n)`, all row-major and contiguous.
pub fn mm<F: Float>(a: &[F], b: &[F], c: &mut [F], m: usize, k: usize, n: usize, beta: F) {
    gemm(
        m,
        k,
        n,
        F::ONE,
        View::rm(a, k),
        View::rm(b, n),
        beta,
        c,
        n,
        1,
    );
}

/// `C (m x n) = beta * C + A (m x k) * B^T`, with `B` stored row-major `n x k`.
pub fn mm_nt<F: Float>(a: &[F], b: &[F], c: &mut [F], m: usize, k: usize, n: usize, beta: F) {
    gemm(
        m,
        k,
        n,
        F::ONE,
        View::rm(a, k),
        View::rm_t(b, k),
        beta,
        c,
        n,
        1,
    );
}

/// `C (m x n) = beta * C + A^T * B (k x n)`, with `A` stored row-major `k x m`.
pub fn mm_tn<F: Float>(a: &[F], b: &[F], c: &mut [F], m: usize, k: usize, n: usize, beta: F) {
    gemm(
        m,
        k,
        n,
        F::ONE,
        View::rm_t(a, m),
        View::rm(b, n),
        beta,
        c,
        n,
        1,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut t = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = a[i * c + j];
            }
        }
        t
    }

    #[test]
    fn products_match_naive() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.91).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let close = |c: &[f32]| c.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-5);
        let mut c = vec![f32::NAN; m * n];
        mm(&a, &b, &mut c, m, k, n, 0.0);
        assert!(close(&c));
        let bt = transpose(&b, k, n);
        mm_nt(&a, &bt, &mut c, m, k, n, 0.0);
        assert!(close(&c));
        let at = transpose(&a, m, k);
        mm_tn(&at, &b, &mut c, m, k, n, 0.0);
        assert!(close(&c));
        mm(&a, &b, &mut c, m, k, n, 1.0);
        assert!(c.iter().zip(&want).all(|(x, y)| (x - 2.0 * y).abs() < 1e-5));
    }
}
