//! The element type of the model: `f32` (what the runtime moves; matrix products via
//! `sgemm`) or `f64` (the same code, for gradient checks; via `dgemm`).

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point element type with a `matrixmultiply` kernel.
pub trait Float:
    Copy
    + Default
    + PartialOrd
    + Debug
    + Send
    + Sync
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Sum
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    fn max(self, other: Self) -> Self;

    /// `matrixmultiply`'s `sgemm`/`dgemm`.
    ///
    /// # Safety
    /// As `matrixmultiply::sgemm`: every element addressed through the pointers and
    /// strides must be in bounds, and `c` must alias neither `a` nor `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

macro_rules! float_impl {
    ($t:ty, $gemm:path) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn of(x: f64) -> Self {
                x as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            unsafe fn gemm(
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: *const Self,
                rsa: isize,
                csa: isize,
                b: *const Self,
                rsb: isize,
                csb: isize,
                beta: Self,
                c: *mut Self,
                rsc: isize,
                csc: isize,
            ) {
                // SAFETY: forwarded from the caller's contract.
                unsafe { $gemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
            }
        }
    };
}

float_impl!(f32, matrixmultiply::sgemm);
float_impl!(f64, matrixmultiply::dgemm);
