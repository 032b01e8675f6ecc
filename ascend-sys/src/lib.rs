//! # ascend-sys
//!
//! Will hold bindgen bindings over the AscendCL/HCCL subset a pipeline runtime needs,
//! with a host emulator (issue 5). Nothing is bound yet: this crate only reserves its
//! place in the workspace.
