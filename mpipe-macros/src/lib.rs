//! # mpipe-macros
//!
//! Will hold the `schedule!` procedural macro (issue 3), a thin shell over
//! `mpipe-core`. Nothing is exported yet: this crate only reserves its place in the
//! workspace so the layout is the one the project's design asks for.
