// Planted SLOUGHING axpy candidate (machinery test on any GPU): the in-tree body, but the call is
// cut into 2x the instance count (see gemv_m1_sloughing.cuh for why this is a gate directive).
// Time it against a baseline that leaves workers idle (e.g. --tiles 32 at nw 132).
// megart-faithful: include-baseline
// megart-faithful: tiles=2x
