// SINGD_CPU_CLONES: build a CPU loop twice, for AVX2 and for the baseline x86-64 ISA, and
// let the loader pick one per CPU (GCC/Clang function multiversioning: an ELF ifunc). A loop so
// marked must compute each result by the same IEEE operations in the same order whatever
// the vector width: elementwise math, or sums kept in explicit lanes or per column. With
// -ffp-contract=off (no FMA) both builds then give bitwise equal results; AVX2 handles
// twice as many floats per instruction (the diagonal step's divisions, above all).
#pragma once

#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define SINGD_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SINGD_CPU_CLONES
#endif
