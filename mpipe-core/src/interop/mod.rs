//! Floor 4, interop: PyTorch schedule CSVs in and out ([`torch_csv`]) and a run's
//! measured costs read back from its trace ([`calibrate`]).

pub mod calibrate;
pub mod torch_csv;
