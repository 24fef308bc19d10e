//! Entry points for the fuzz targets in `fuzz/`: thin wrappers that run the
//! engine's crate-private decoders of peer bytes on arbitrary input. Not
//! part of the supported API (hidden from the docs, may change at any time).
