// Planted SLOUGHING gemv_m1 candidate (megart.faithful's own test). The body is the in-tree one,
// unchanged; what changes is the split: the call is cut into 2x the production instance count, so
// each CTA streams half the rows and more CTAs take part. slowCTA falls, but the same bytes are
// just spread over more CTAs - CTAs that, in the real megakernel, belong to co-resident tasks - so
// sumCTA rises (or at best stays) and compare must reject it as SLOUGHING, never call it a WIN.
//
// In a persistent kernel the instance count is fixed by the graph, not by the body, so a candidate
// cannot spread itself; the `tiles=2x` directive asks the gate to build the call that way. It only
// shows where the baseline call leaves workers idle (instances < nw), e.g. --tiles 16 at nw 132
// (16 -> 32 CTAs: both far from saturating HBM, so slowCTA halves while sumCTA does not fall).
// megart-faithful: include-baseline
// megart-faithful: tiles=2x
