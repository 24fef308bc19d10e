//! The planner's rejections (docs/plan-scenario.md §4), one variant per case.
//!
//! Every failure the reference would report for a configuration or a chunk (an
//! exception, or a `-1` status from one of its send paths) is one of these.
//! A rejection means no plan at all: the planner never hands out a partial
//! block list.

use crate::layout::StateType;

/// Why the planner rejects a configuration or a chunk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    // ----- configuration invariants -------------------------------------------------
    /// A size that must be at least 1 (TP, PP, page size) is 0.
    #[error("invalid configuration: {field} must be at least 1")]
    ZeroSize {
        /// The offending field.
        field: &'static str,
    },

    // ----- DCP registration (§3.1) ----------------------------------------------------
    /// Equal DCP sizes on both peers, but the decode connected a different DCP rank.
    #[error("PD peers must connect matching DCP ranks, got prefill={prefill}, decode={decode}")]
    DcpRankMismatch {
        /// Prefill DCP rank.
        prefill: u64,
        /// Decode DCP rank.
        decode: u64,
    },
    /// Different DCP sizes that the relayout cannot handle (prefill DCP > 1, or a non-MLA pool).
    #[error(
        "unsupported PD DCP topology: {prefill} -> {decode} (relayout needs prefill DCP 1, decode DCP > 1 and an MLA pool)"
    )]
    UnsupportedDcpTopology {
        /// Prefill DCP size.
        prefill: u64,
        /// Decode DCP size.
        decode: u64,
    },
    /// DCP relayout with more draft entries than KV entries.
    #[error(
        "PD DCP requires one decode KV entry per prefill entry: {entries} entries, {draft} of them draft"
    )]
    DcpDraftEntries {
        /// Number of prefill KV entries.
        entries: usize,
        /// Declared draft entries.
        draft: u64,
    },
    /// DCP relayout: a target entry's bytes per token differ between the peers.
    #[error(
        "PD DCP source/destination KV geometry differs at entry {entry}: prefill token bytes {src}, decode token bytes {dst}"
    )]
    DcpTokenWidthMismatch {
        /// Entry index.
        entry: usize,
        /// Prefill bytes per token.
        src: u64,
        /// Decode bytes per token.
        dst: u64,
    },

    // ----- unified memory (§3.3 b) ------------------------------------------------------
    /// Unified-memory envelope layout with different attention TP sizes.
    #[error(
        "unified memory does not support different prefill/decode attention TP sizes (prefill={prefill}, decode={decode})"
    )]
    UnifiedMemoryTpMismatch {
        /// Prefill attention TP size.
        prefill: u64,
        /// Decode attention TP size.
        decode: u64,
    },
    /// Unified-memory envelope layout: not exactly one KV region each, or item sizes differ.
    #[error(
        "PD KV layout mismatch on the whole-envelope path: prefill has {src_regions} KV region(s), decode has {dst_regions} with item_len={dst_item_len}"
    )]
    UnifiedMemoryLayoutMismatch {
        /// Prefill KV regions.
        src_regions: usize,
        /// Decode KV regions.
        dst_regions: usize,
        /// Decode KV item size.
        dst_item_len: u64,
    },

    // ----- layer pairing (§3.4) ---------------------------------------------------------
    /// Layer ids published by one peer only, and positional fallback is not allowed (PP > 1).
    #[error("layer metadata must be provided by both PD peers or neither")]
    LayerIdsOneSided,
    /// A layer id list does not cover its buffers exactly.
    #[error(
        "layer metadata length must match transfer entries: src ids={src_ids} entries={n_src}, dst ids={dst_ids} entries={n_dst}"
    )]
    LayerIdCountMismatch {
        /// Prefill id count.
        src_ids: usize,
        /// Prefill buffer count.
        n_src: usize,
        /// Decode id count.
        dst_ids: usize,
        /// Decode buffer count.
        n_dst: usize,
    },
    /// The decode has no (further) entry for a prefill layer id.
    #[error("decode peer is missing a transfer entry for model layer {layer}")]
    MissingDecodeLayer {
        /// The missing global layer id.
        layer: i64,
    },
    /// Positional pairing with fewer decode buffers (or, with PP > 1, a different count).
    #[error(
        "PP-heterogeneous transfer requires layer ids on both peers; got src={n_src} dst={n_dst} entries"
    )]
    PositionalPairing {
        /// Prefill buffer count.
        n_src: usize,
        /// Decode buffer count.
        n_dst: usize,
    },
    /// Flat (MLA) PP-stage pairing runs past the decode's buffer list.
    #[error(
        "flat PP-stage pairing: prefill entry {entry} has no decode entry (decode slice holds {dst_entries})"
    )]
    FlatPairingOutOfRange {
        /// Prefill entry without a partner.
        entry: usize,
        /// Length of the decode slice.
        dst_entries: usize,
    },
    /// MHA K/V halves: this stage has more layers than the decode's K list provides.
    #[error("prefill stage has {layers} layers but the decode K list provides {dst_layers}")]
    StageLayersBeyondDecode {
        /// Layers of this stage.
        layers: usize,
        /// Decode K buffers available.
        dst_layers: usize,
    },
    /// MHA K/V halves: the decode has no V buffer for a layer.
    #[error("decode has no V buffer for stage layer {layer}")]
    MissingDecodeV {
        /// Stage-local layer index.
        layer: usize,
    },
    /// MHA K/V halves: the prefill has no K/V layer but the decode has some.
    #[error("prefill has no K/V layer pair but the decode has {dst_layers}")]
    EmptyKvHalves {
        /// Decode K/V layer pairs.
        dst_layers: usize,
    },
    /// A buffer has no item size (the size list is shorter than the buffer list).
    #[error("{what} has no item size for entry {entry}")]
    MissingItemLen {
        /// Which list.
        what: &'static str,
        /// The entry without a size.
        entry: usize,
    },

    // ----- index lists --------------------------------------------------------------------
    /// Both index lists non-empty with different lengths where runs are formed.
    #[error("index lists differ in length: prefill={src}, decode={dst}")]
    IndexLengthMismatch {
        /// Prefill index count.
        src: usize,
        /// Decode index count.
        dst: usize,
    },
    /// An index is negative (or does not fit the index type).
    #[error("invalid {what} index {value}")]
    InvalidIndex {
        /// Which index list.
        what: &'static str,
        /// The offending value.
        value: i64,
    },

    // ----- head slicing (§3.5) -------------------------------------------------------------
    /// Head slicing with layer ids needs one item size for every KV entry.
    #[error("head-sliced transfer assumes one item length for every KV entry")]
    MixedKvItemLens,
    /// The head slice is wider than the decode's token slot.
    #[error("slice size ({slice}) exceeds target token slot size ({slot})")]
    SliceTooWide {
        /// Bytes per token to send.
        slice: u64,
        /// Decode bytes per token.
        slot: u64,
    },

    // ----- DCP chunk (§3.6) ------------------------------------------------------------------
    /// DCP relayout needs `num_kv_tokens`.
    #[error("PD DCP transfer requires num_kv_tokens")]
    MissingNumKvTokens,
    /// `dst_kv_item_lens` given with a length different from `dst_kv_ptrs`.
    #[error("PD DCP destination KV lengths ({lens}) must match its buffers ({ptrs})")]
    DstKvItemLensLength {
        /// Lengths given.
        lens: usize,
        /// Decode buffers.
        ptrs: usize,
    },
    /// `decode_prefix_len` is not a multiple of the virtual DCP page.
    #[error(
        "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size ({virtual_page}), got {prefix}"
    )]
    MisalignedDecodePrefix {
        /// Decode prefix length.
        prefix: u64,
        /// Virtual page size (`page_size * dst_dcp_size`).
        virtual_page: u64,
    },
    /// A DCP token maps past the end of a page list.
    #[error("PD DCP token maps to {what} page {index}, past the end of the list ({len})")]
    DcpIndexOutOfRange {
        /// Which page list.
        what: &'static str,
        /// The position looked up.
        index: u64,
        /// The list length.
        len: usize,
    },
    /// A DCP entry has no decode buffer.
    #[error("PD DCP entry {entry} has no decode buffer ({dst_entries} mapped)")]
    DcpEntryOutOfRange {
        /// Prefill entry.
        entry: usize,
        /// Mapped decode entries.
        dst_entries: usize,
    },
    /// Draft entries with different TP sizes need the decode's per-entry KV lengths.
    #[error("PD DCP with different draft TP sizes requires destination KV lengths")]
    DraftTpWithoutItemLens,
    /// A draft entry's decode token width is not a positive whole number of bytes.
    #[error("invalid PD DCP draft destination token width at entry {entry}")]
    DraftWidthInvalid {
        /// Draft entry.
        entry: usize,
    },
    /// Draft head slicing on a pure MLA pool.
    #[error("PD DCP draft head slicing is unsupported for pure MLA")]
    DraftHeadSlicingOnMla,
    /// Draft head shards do not divide evenly.
    #[error(
        "PD DCP draft KV head shards must divide evenly (prefill width {src}, decode width {dst})"
    )]
    DraftShardsNotDivisible {
        /// Prefill bytes per token.
        src: u64,
        /// Decode bytes per token.
        dst: u64,
    },

    // ----- states (§3.7) -------------------------------------------------------------------
    /// The prefill declares a state component but registered no buffers/sizes for it.
    #[error("state component {component} has no registered {what}")]
    MissingStateBuffers {
        /// Component index.
        component: usize,
        /// Which list is missing.
        what: &'static str,
    },
    /// Mamba item sizes differ and there is no per-tensor dim metadata to reslice.
    #[error(
        "mamba state layouts differ between prefill and decode (component {component}) and no dim metadata is available to reslice"
    )]
    MambaLayoutMismatch {
        /// Component index.
        component: usize,
    },
    /// Mamba needs exactly one prefill slot index.
    #[error("mamba should have a single state index, got {count} (component {component})")]
    MambaSlotCount {
        /// Component index.
        component: usize,
        /// Indices given.
        count: usize,
    },
    /// Mamba slot sizes differ between paired buffers.
    #[error(
        "prefill/decode mamba slot size mismatch (src={src}, dst={dst}, component {component})"
    )]
    MambaSlotSizeMismatch {
        /// Component index.
        component: usize,
        /// Prefill slot bytes.
        src: u64,
        /// Decode slot bytes.
        dst: u64,
    },
    /// A per-buffer metadata value is missing for a paired state buffer.
    #[error("state component {component}: {what} missing for entry {entry}")]
    MissingStateMetadata {
        /// Component index.
        component: usize,
        /// Which metadata.
        what: &'static str,
        /// The entry.
        entry: usize,
    },
    /// The decode gave no state index for a component that sends data.
    #[error("state component {component}: decode state index missing")]
    MissingDstStateIndex {
        /// Component index.
        component: usize,
    },
    /// One peer marks a mamba item replicated (dim 0), the other does not.
    #[error(
        "mamba state replication metadata differs between prefill and decode (component {component})"
    )]
    MambaReplicationMismatch {
        /// Component index.
        component: usize,
    },
    /// Replicated mamba items differ in size.
    #[error("replicated mamba state item lengths differ: {src} != {dst} (component {component})")]
    MambaReplicatedSizeMismatch {
        /// Component index.
        component: usize,
        /// Prefill bytes.
        src: u64,
        /// Decode bytes.
        dst: u64,
    },
    /// Replicated state needs one attention TP size to divide the other.
    #[error(
        "one attention TP size must divide the other for replicated-state transfer: src={prefill}, dst={decode}"
    )]
    TpNotDivisible {
        /// Prefill attention TP size.
        prefill: u64,
        /// Decode attention TP size.
        decode: u64,
    },
    /// A divisor derived from state metadata is zero (outer count, sub-block shard).
    #[error("state component {component}: {what} is zero")]
    ZeroStateDivisor {
        /// Component index.
        component: usize,
        /// Which divisor.
        what: &'static str,
    },
    /// Page-indexed state of a non-MLA model with different TP sizes.
    #[error("PD disaggregation does not support different TP sizes for non-MLA {state_type} state")]
    PagedStateTpMismatch {
        /// The component's type.
        state_type: StateType,
    },
    /// SWA head slicing (different TP sizes) with pipeline parallelism: the
    /// SWA pool has no layer ids and restarts at layer 0 on every stage.
    #[error(
        "PD disaggregation does not support different TP sizes for non-MLA SWA state with \
         pipeline parallelism (prefill pp_size={pp_size})"
    )]
    SwaHeadSlicePipeline {
        /// Prefill PP size.
        pp_size: u64,
    },
    /// SWA head slicing needs NHD pages (`[page_size, heads, head_dim]`).
    #[error("head-sliced SWA transfer needs the NHD KV cache layout, got {layout}")]
    SwaHeadSliceLayout {
        /// The SWA sub-pool's layout (`swa_kv_cache_layout`).
        layout: String,
    },
    /// SWA head slicing needs per-layer K and V buffers on both sides.
    #[error(
        "head-sliced SWA transfer needs matching per-layer K/V buffers: prefill has {src} \
         entries, decode has {dst}"
    )]
    SwaHeadSliceEntries {
        /// Prefill SWA buffers.
        src: usize,
        /// Decode SWA buffers.
        dst: usize,
    },
    /// SWA head slicing: an item size is not `page_size` tokens of whole heads.
    #[error(
        "SWA item lengths (prefill={src_item}, decode={dst_item}) do not split into \
         {src_heads} and {dst_heads} heads of {total_heads} total with page_size={page_size}"
    )]
    SwaHeadSliceItemLens {
        /// Prefill bytes per page.
        src_item: u64,
        /// Decode bytes per page.
        dst_item: u64,
        /// Prefill heads per rank.
        src_heads: u64,
        /// Decode heads per rank.
        dst_heads: u64,
        /// Model's KV heads.
        total_heads: u64,
        /// Tokens per page.
        page_size: u64,
    },
    /// Replicated QSA: decode buffer and size lists differ in length.
    #[error(
        "replicated {state_type} destination metadata is inconsistent: ptrs={ptrs} lens={lens}"
    )]
    QsaMetadataMismatch {
        /// The component's type.
        state_type: StateType,
        /// Decode buffers.
        ptrs: usize,
        /// Decode sizes.
        lens: usize,
    },
    /// Replicated QSA: paired entries differ in item size.
    #[error(
        "replicated {state_type} layout differs: prefill entry {src_entry} has {src} bytes, decode entry {dst_entry} has {dst}"
    )]
    QsaLayoutMismatch {
        /// The component's type.
        state_type: StateType,
        /// Prefill entry.
        src_entry: usize,
        /// Decode entry.
        dst_entry: usize,
        /// Prefill item bytes.
        src: u64,
        /// Decode item bytes.
        dst: u64,
    },
    /// A position-indexed state type got index lists of different lengths.
    #[error("{state_type} state index length mismatch: prefill={src}, dst={dst}")]
    StateIndexLengthMismatch {
        /// The component's type.
        state_type: StateType,
        /// Prefill index count.
        src: usize,
        /// Decode index count.
        dst: usize,
    },
    /// The planner broke one of its own invariants (a bug, never an input).
    #[error("internal planner error: {0}")]
    Internal(&'static str),
    /// MiniMax sparse index with pipeline parallelism.
    #[error("PD disagg: PP > 1 not supported for MiniMax sparse index")]
    MinimaxPipeline,
    /// MiniMax sparse index with different TP sizes.
    #[error(
        "PD disagg: heterogeneous TP not supported for MiniMax sparse index (prefill={prefill}, decode={decode})"
    )]
    MinimaxTpMismatch {
        /// Prefill attention TP size.
        prefill: u64,
        /// Decode attention TP size.
        decode: u64,
    },
    /// A compressed-MLA (DeepSeek-V4) layout cannot be paired or addressed.
    #[error("compressed MLA: {0}")]
    CompressedMla(#[from] CompressedMlaError),
    /// DSA tail ring remapping failed.
    #[error("dsa_tail (component {component}): {reason}")]
    DsaTail {
        /// Component index.
        component: usize,
        /// What is wrong.
        reason: DsaTailError,
    },

    // ----- aux (§3.8) ---------------------------------------------------------------------------
    /// The decode has more aux buffers than the prefill.
    #[error("decode aux buffer {index} has no prefill aux buffer/size")]
    MissingAuxBuffer {
        /// Aux buffer index.
        index: usize,
    },
    /// Last chunk without a prefill aux slot.
    #[error("last chunk carries no prefill aux index")]
    MissingAuxIndex,

    // ----- staging (heterogeneous TP) ------------------------------------------------------
    /// The peers' layouts take the per-slice path, not staging.
    #[error("staging does not apply: {reason}")]
    StagingUnsupported {
        /// Why.
        reason: &'static str,
    },

    // ----- arithmetic -------------------------------------------------------------------------------
    /// An address or length of the plan would not fit in 64 bits.
    #[error("address arithmetic overflows 64 bits")]
    AddressOverflow,
    /// Head slicing and the DCP token relayout compute addresses in signed
    /// 64-bit arithmetic (the reference uses numpy int64 there, which rejects
    /// larger inputs and wraps larger results); a value past `i64::MAX`.
    #[error("{what} exceeds the signed 64-bit range of the head-slice/DCP address arithmetic")]
    SignedOverflow {
        /// Which value.
        what: &'static str,
    },
}

/// Why a DSA tail ring remap is rejected (`build_dsa_tail_transfer_blocks`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DsaTailError {
    /// Key/score halves: a pointer list of odd length when counts differ.
    #[error("pointer lists must contain equal key/score halves, got src={src}, dst={dst}")]
    OddHalves {
        /// Prefill buffer count.
        src: usize,
        /// Decode list length.
        dst: usize,
    },
    /// The prefill stage's layers do not fit in the decode's lists.
    #[error("pointer count mismatch: src={src}, dst={dst}, prefill layers end at {end}")]
    StageBeyondDecode {
        /// Prefill buffer count.
        src: usize,
        /// Decode list length.
        dst: usize,
        /// End layer of the stage.
        end: u64,
    },
    /// One side gave a slot tuple, the other none.
    #[error("slot index missing on one side")]
    OneSided,
    /// A slot tuple is not `[row, off1, n1, off2, n2, ring]`.
    #[error("slot indices must be 6-tuples, got {src} and {dst} values")]
    NotSixTuple {
        /// Prefill tuple length.
        src: usize,
        /// Decode tuple length.
        dst: usize,
    },
    /// Buffer / size lists differ in length.
    #[error(
        "pointer metadata mismatch: src ptrs={src_ptrs}, dst ptrs={dst_ptrs}, src lens={src_lens}, dst lens={dst_lens}"
    )]
    MetadataMismatch {
        /// Prefill buffers.
        src_ptrs: usize,
        /// Decode buffers.
        dst_ptrs: usize,
        /// Prefill sizes.
        src_lens: usize,
        /// Decode sizes.
        dst_lens: usize,
    },
    /// A ring size is not positive.
    #[error("ring sizes must be positive: src={src}, dst={dst}")]
    RingSize {
        /// Prefill ring slots.
        src: i64,
        /// Decode ring slots.
        dst: i64,
    },
    /// A live segment has a negative offset or length.
    #[error("segment offsets and lengths must be non-negative")]
    NegativeSegment,
    /// A live segment leaves the ring.
    #[error("segment ({off}, {len}) exceeds ring size {ring}")]
    SegmentBeyondRing {
        /// Segment offset.
        off: i64,
        /// Segment length.
        len: i64,
        /// Ring slots.
        ring: i64,
    },
    /// The two sides hold different numbers of live slots.
    #[error("live-token count mismatch: src={src}, dst={dst}")]
    LiveCountMismatch {
        /// Prefill live slots.
        src: i64,
        /// Decode live slots.
        dst: i64,
    },
    /// A request row index is negative.
    #[error("request row indices must be non-negative")]
    NegativeRow,
    /// A row size is not a positive multiple of its ring size.
    #[error("tail row size {row_bytes} is not divisible by ring size {ring}")]
    RowNotDivisible {
        /// Row bytes.
        row_bytes: u64,
        /// Ring slots.
        ring: i64,
    },
    /// Per-slot sizes differ between the peers.
    #[error("slot-size mismatch: src={src}, dst={dst}")]
    SlotSizeMismatch {
        /// Prefill bytes per slot.
        src: u64,
        /// Decode bytes per slot.
        dst: u64,
    },
}

/// Why a compressed-MLA layout cannot be paired or addressed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CompressedMlaError {
    /// A stage must name its end layer to be sliced out of a whole-model list.
    #[error("slicing a whole-model decode list to a PP stage needs prefill_end_layer")]
    MissingEndLayer,
    /// The stage's layers run past the model's ratio list.
    #[error("stage layers {start}..{end} run past the model's {layers} compression ratios")]
    StageOutsideModel {
        /// First layer of the stage.
        start: u64,
        /// End layer of the stage.
        end: u64,
        /// Layers the ratio list describes.
        layers: usize,
    },
    /// One peer uses the single-pool layout, the other the fp8 two-pool one.
    #[error(
        "PD peers disagree on the compressed-MLA KV layout: prefill {src} buffers, decode {dst} \
         (single pool {single}, two-pool {two}); use the same KV layout on both"
    )]
    LayoutDisagreement {
        /// Prefill buffers.
        src: usize,
        /// Decode buffers.
        dst: usize,
        /// Buffers of the single-pool layout.
        single: usize,
        /// Buffers of the two-pool layout.
        two: usize,
    },
    /// The decode's KV list is not the three-group layout a stage slices
    /// out of (draft entries, the two-pool layout, ratio-1/2 layers).
    #[error(
        "the decode's {dst} KV buffers are not the compressed layout of {kv_len} (C4 KV, C4 \
         indexer, C128 KV), so a PP stage cannot be sliced out of them"
    )]
    UnsliceableKv {
        /// Decode buffers.
        dst: usize,
        /// Buffers of the three-group layout.
        kv_len: usize,
    },
    /// An SWA-state list that cannot hold the model's C4 groups.
    #[error(
        "the decode's {dst} SWA-state buffers cannot hold {c4} C4 layers twice plus the SWA layers"
    )]
    SwaStateLayout {
        /// Decode buffers.
        dst: usize,
        /// C4 layers of the model.
        c4: usize,
    },
    /// The sliced decode list is shorter than the stage's.
    #[error("the stage's buffer {entry} has no decode buffer (the slice holds {dst_entries})")]
    SliceShort {
        /// Prefill buffer without a partner.
        entry: usize,
        /// Buffers in the slice.
        dst_entries: usize,
    },
    /// HiSparse device pages for a pool that has no compression ratios.
    #[error("HiSparse device destinations (dst_device_kv_indices) need a compressed-MLA pool")]
    DeviceWithoutCompression,
    /// HiSparse device pages through the DCP relayout.
    #[error("HiSparse device destinations cannot be combined with the DCP relayout")]
    DeviceWithDcp,
    /// Fewer device pages than prefill pages in a chunk.
    #[error("HiSparse: {device} device destination pages for {pages} prefill pages")]
    DeviceIndicesShort {
        /// Device pages available for the chunk.
        device: usize,
        /// Prefill pages of the chunk.
        pages: usize,
    },
}
