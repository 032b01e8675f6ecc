//! Floor 2, judging programs: validity ([`verify`]), execution and its time and
//! memory ([`simulate`], [`timeline`], [`waits`]), lower bounds ([`bound`]) and
//! advice on what a program's figures mean ([`advice`]). It reads a `Program` (and,
//! for the bound and advice, a profile, the algebra's stage splits and body names),
//! never how a program was made.

pub mod advice;
pub mod bound;
pub(crate) mod coll_ids;
pub mod compare;
pub(crate) mod resume;
pub mod simulate;
pub mod timeline;
pub mod verify;
pub mod waits;
