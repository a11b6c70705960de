// Decode attention over paged K/V in host memory, for CPU threads: (out, lse).
//
// One query token per sequence, grouped query heads (all query heads of a kv head in one
// pass, so every K/V byte is read once), fp32 accumulation. K/V rows are bf16 or fp32,
// `head_dim` elements each, in pages of `page_size` rows; a sequence's pages come from its
// block table. Work is split into tasks of (sequence, kv head, block of tokens), each
// writing a partial (max, sum, acc); a second pass merges the partials by log-sum-exp.
// The merge order is fixed, so the result does not depend on the number of threads.
//
// A C ABI (no torch headers), called through ctypes on data pointers. On x86-64 the hot
// function is compiled for AVX-512, AVX2 and the baseline ISA and picked at load time.

#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HS_CLONES
#endif
#define HS_INLINE __attribute__((always_inline)) inline

namespace {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;
constexpr int kMaxDim = 512;
constexpr int kMaxGroup = 64;
constexpr int kMaxBlock = 1024;
constexpr int kMaxScores = 16384;  // group * block_tokens: scores of one task, on the stack

struct Problem {
  const float* q;          // [seqs, kv_heads, group, dim]
  const void* k;           // head h, slot s at k + h * head_stride + s * dim (elements)
  const void* v;
  int64_t head_stride;
  const int32_t* tables;   // [seqs, table_stride]
  int64_t table_stride;
  const int32_t* starts;   // [seqs] first token attended, or null (0)
  const int32_t* ends;     // [seqs] one past the last token attended
  int num_seqs, num_kv_heads, group, dim, page_size, block_tokens;
  float scale;
  float* probs;            // [seqs, kv_heads, group, probs_stride] softmax weights, or null
  int64_t probs_stride;
};

// The raw scores of a block's queries, kept for the weights pass (`raw` null: not asked).
HS_INLINE void keep_scores(const float* scores, int group, int stride, int num, float* raw,
                           int64_t raw_stride) {
  if (raw == nullptr) return;
  for (int g = 0; g < group; ++g)
    std::memcpy(raw + g * raw_stride, scores + g * stride, sizeof(float) * num);
}

HS_INLINE void load_row(const float* src, float* dst, int dim) {
  std::memcpy(dst, src, sizeof(float) * dim);
}

HS_INLINE void load_row(const uint16_t* src, float* dst, int dim) {
#pragma omp simd
  for (int d = 0; d < dim; ++d)  // bf16 is the high half of an fp32
    dst[d] = __builtin_bit_cast(float, uint32_t(src[d]) << 16);
}

// Tokens [t0, t1) of one (sequence, kv head): part = [group][dim + 2] as (acc..., max, sum).
template <typename T>
HS_INLINE void attend_block(const Problem& p, const T* k, const T* v, const int32_t* table,
                            const float* q, int t0, int t1, float* part, float* raw) {
  const int dim = p.dim, group = p.group, num = t1 - t0;
  alignas(64) float row[kMaxDim];
  alignas(64) float scores[kMaxScores];
  const int stride = p.block_tokens;
  for (int i = 0; i < num; ++i) {
    const int t = t0 + i;
    const int64_t slot = int64_t(table[t / p.page_size]) * p.page_size + t % p.page_size;
    load_row(k + slot * dim, row, dim);
    for (int g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < dim; ++d) dot += qg[d] * row[d];
      scores[g * stride + i] = dot * p.scale;
    }
  }
  keep_scores(scores, group, stride, num, raw, p.probs_stride);
  for (int g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    float top = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < num; ++i) top = std::max(top, s[i]);
    float sum = 0.f;
    for (int i = 0; i < num; ++i) {
      s[i] = std::exp(s[i] - top);
      sum += s[i];
    }
    float* acc = part + g * (dim + 2);
    std::memset(acc, 0, sizeof(float) * dim);
    acc[dim] = top;
    acc[dim + 1] = sum;
  }
  for (int i = 0; i < num; ++i) {
    const int t = t0 + i;
    const int64_t slot = int64_t(table[t / p.page_size]) * p.page_size + t % p.page_size;
    load_row(v + slot * dim, row, dim);
    for (int g = 0; g < group; ++g) {
      const float w = scores[g * stride + i];
      float* acc = part + g * (dim + 2);
#pragma omp simd
      for (int d = 0; d < dim; ++d) acc[d] += w * row[d];
    }
  }
}

// The portable loops, compiled for each ISA by the compiler and chosen at load time.
HS_CLONES void attend_block_portable(const Problem& p, bool bf16, const void* k, const void* v,
                                     const int32_t* table, const float* q, int t0, int t1,
                                     float* part, float* raw) {
  if (bf16)
    attend_block(p, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), table, q,
                 t0, t1, part, raw);
  else
    attend_block(p, static_cast<const float*>(k), static_cast<const float*>(v), table, q, t0,
                 t1, part, raw);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// Prefetch the row `ahead` tokens on (hardware prefetchers stop at 4 KiB page boundaries,
// every 16 rows of bf16 K at head dim 128).
constexpr int kAhead = 8;
template <typename T>
HS_INLINE void prefetch_row(const T* base, const int64_t* slots, int i, int num, int dim) {
  if (i + kAhead >= num) return;
  const char* row = reinterpret_cast<const char*>(base + slots[i + kAhead] * dim);
  for (int byte = 0; byte < int(dim * sizeof(T)); byte += 64)
    _mm_prefetch(row + byte, _MM_HINT_T0);
}

// AVX-512: 16 dims of a row as fp32 (bf16 widened: the high half of an fp32).
HS_AVX512 HS_INLINE __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
HS_AVX512 HS_INLINE __m512 load16(const uint16_t* src) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// acc[g][c] += w[g][t] * v[t][offset + 16 c] for NG queries and NC vectors of 16 dims,
// accumulators held in registers over the whole block.
template <typename T, int NG, int NC>
HS_AVX512 HS_INLINE void accumulate(const T* v, const int64_t* slots, int num, int dim,
                                    const float* w, int stride, int offset, float* part) {
  __m512 acc[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int i = 0; i < num; ++i) {
    if (offset == 0) prefetch_row(v, slots, i, num, dim);
    const T* row = v + slots[i] * dim + offset;
    __m512 x[NC];
    for (int c = 0; c < NC; ++c) x[c] = load16(row + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const __m512 weight = _mm512_set1_ps(w[g * stride + i]);
      for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(weight, x[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(part + g * (dim + 2) + offset + 16 * c, acc[g][c]);
}

template <typename T, int NG>
HS_AVX512 HS_INLINE void accumulate_dims(const T* v, const int64_t* slots, int num, int dim,
                                         const float* w, int stride, float* part) {
  int offset = 0;
  for (; offset + 64 <= dim; offset += 64)
    accumulate<T, NG, 4>(v, slots, num, dim, w, stride, offset, part);
  for (; offset < dim; offset += 16)
    accumulate<T, NG, 1>(v, slots, num, dim, w, stride, offset, part);
}

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (relative error below 1e-8), scaled by 2^n.
HS_AVX512 HS_INLINE __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));  // e^-103 is below the smallest fp32
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// scores[g][i] = scale * q[g] . k[slot i] for NG queries at once (independent chains).
template <typename T, int NG>
HS_AVX512 HS_INLINE void scores_of(const T* k, const int64_t* slots, int num, int dim,
                                   const float* q, float scale, int stride, float* scores) {
  for (int i = 0; i < num; ++i) {
    prefetch_row(k, slots, i, num, dim);
    const T* row = k + slots[i] * dim;
    __m512 even[NG], odd[NG];
    for (int g = 0; g < NG; ++g) even[g] = odd[g] = _mm512_setzero_ps();
    int d = 0;
    for (; d + 32 <= dim; d += 32) {
      const __m512 x0 = load16(row + d), x1 = load16(row + d + 16);
      for (int g = 0; g < NG; ++g) {
        even[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + d), x0, even[g]);
        odd[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + d + 16), x1, odd[g]);
      }
    }
    if (d < dim) {
      const __m512 x0 = load16(row + d);
      for (int g = 0; g < NG; ++g)
        even[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + d), x0, even[g]);
    }
    for (int g = 0; g < NG; ++g)
      scores[g * stride + i] = _mm512_reduce_add_ps(_mm512_add_ps(even[g], odd[g])) * scale;
  }
}

// s[i] = exp(s[i] - max s) in place; returns (max, sum).
HS_AVX512 HS_INLINE void softmax_row(float* s, int num, float* top_out, float* sum_out) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + 16 <= num; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + i));
  const __mmask16 tail = __mmask16((1u << (num - i)) - 1);
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + i));
  const float top_value = _mm512_reduce_max_ps(top);
  const __m512 shift = _mm512_set1_ps(top_value);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= num; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < num) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), shift));
    _mm512_mask_storeu_ps(s + i, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  *top_out = top_value;
  *sum_out = _mm512_reduce_add_ps(sum);
}

template <typename T, int NG>
HS_AVX512 HS_INLINE void attend_queries(const Problem& p, const T* k, const T* v,
                                        const int64_t* slots, int num, const float* q,
                                        float* scores, float* part, float* raw) {
  const int dim = p.dim, stride = p.block_tokens;
  scores_of<T, NG>(k, slots, num, dim, q, p.scale, stride, scores);
  keep_scores(scores, NG, stride, num, raw, p.probs_stride);
  for (int g = 0; g < NG; ++g)
    softmax_row(scores + g * stride, num, part + g * (dim + 2) + dim,
                part + g * (dim + 2) + dim + 1);
  accumulate_dims<T, NG>(v, slots, num, dim, scores, stride, part);
}

template <typename T>
HS_AVX512 void attend_block_avx512(const Problem& p, const T* k, const T* v,
                                   const int32_t* table, const float* q, int t0, int t1,
                                   float* part, float* raw) {
  const int dim = p.dim, group = p.group, num = t1 - t0, stride = p.block_tokens;
  alignas(64) float scores[kMaxScores];
  int64_t slots[kMaxBlock];
  for (int i = 0; i < num; ++i) {
    const int t = t0 + i;
    slots[i] = int64_t(table[t / p.page_size]) * p.page_size + t % p.page_size;
  }
  int g = 0;  // queries of the group four at a time: each pass reads the block's K/V once
  for (; g + 4 <= group; g += 4)
    attend_queries<T, 4>(p, k, v, slots, num, q + g * dim, scores + g * stride,
                         part + g * (dim + 2), raw ? raw + g * p.probs_stride : nullptr);
  if (group - g == 3)
    attend_queries<T, 3>(p, k, v, slots, num, q + g * dim, scores + g * stride,
                         part + g * (dim + 2), raw ? raw + g * p.probs_stride : nullptr);
  else if (group - g == 2)
    attend_queries<T, 2>(p, k, v, slots, num, q + g * dim, scores + g * stride,
                         part + g * (dim + 2), raw ? raw + g * p.probs_stride : nullptr);
  else if (group - g == 1)
    attend_queries<T, 1>(p, k, v, slots, num, q + g * dim, scores + g * stride,
                         part + g * (dim + 2), raw ? raw + g * p.probs_stride : nullptr);
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#else
bool has_avx512() { return false; }
template <typename T>
void attend_block_avx512(const Problem&, const T*, const T*, const int32_t*, const float*, int,
                         int, float*, float*) {}
#endif

template <typename T>
void attend_task(const Problem& p, bool avx512, int seq, int head, int t0, int t1,
                 float* part) {
  const int64_t offset = head * p.head_stride;
  const int start = p.starts ? p.starts[seq] : 0;
  float* raw = p.probs ? p.probs + (int64_t(seq) * p.num_kv_heads + head) * p.group *
                                       p.probs_stride + (t0 - start)
                       : nullptr;
  const T* k = static_cast<const T*>(p.k) + offset;
  const T* v = static_cast<const T*>(p.v) + offset;
  const int32_t* table = p.tables + seq * p.table_stride;
  const float* q = p.q + (int64_t(seq) * p.num_kv_heads + head) * p.group * p.dim;
  if (avx512)
    attend_block_avx512(p, k, v, table, q, t0, t1, part, raw);
  else
    attend_block_portable(p, std::is_same_v<T, uint16_t>, k, v, table, q, t0, t1, part, raw);
}

// Merge the partials of one (sequence, kv head, query) over its blocks, `stride` apart.
void merge(const float* parts, int num_blocks, int64_t stride, int dim, float* out,
           float* lse) {
  float top = -std::numeric_limits<float>::infinity();
  for (int b = 0; b < num_blocks; ++b) top = std::max(top, parts[b * stride + dim]);
  std::memset(out, 0, sizeof(float) * dim);
  if (num_blocks == 0 || std::isinf(top)) {
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  float sum = 0.f;
  for (int b = 0; b < num_blocks; ++b) {
    const float* part = parts + b * stride;
    const float w = std::exp(part[dim] - top);
    sum += w * part[dim + 1];
    for (int d = 0; d < dim; ++d) out[d] += w * part[d];
  }
  const float inv = 1.f / sum;
  for (int d = 0; d < dim; ++d) out[d] *= inv;
  *lse = top + std::log(sum);
}

}  // namespace

extern "C" {

// The instruction set the clones run with here: 3 AVX-512, 2 AVX2, 1 baseline, 0 not x86.
int hs_isa() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return 3;
  if (__builtin_cpu_supports("x86-64-v3")) return 2;
  return 1;
#else
  return 0;
#endif
}

// Returns 0, or 1 for arguments out of range (nothing written). `allow_avx512` 0 runs the
// portable loops (compiled per ISA by the compiler) even where AVX-512 is there. With
// `probs` (else null), query (seq, head, g)'s softmax weight of token start + j goes to
// probs[((seq * kv_heads + head) * group + g) * probs_stride + j] (HGCA's A_cpu).
int hs_paged_decode(const float* q, const void* k, const void* v, int kv_dtype,
                    int64_t head_stride, const int32_t* tables, int64_t table_stride,
                    const int32_t* starts, const int32_t* ends, int num_seqs,
                    int num_kv_heads, int group, int dim, int page_size, float scale,
                    int block_tokens, int num_threads, int allow_avx512, float* out,
                    float* lse, float* probs, int64_t probs_stride) {
  if (dim > kMaxDim || group > kMaxGroup || block_tokens > kMaxBlock || block_tokens < 1 ||
      group * block_tokens > kMaxScores ||
      (kv_dtype != kF32 && kv_dtype != kBF16) || page_size < 1)
    return 1;
  const Problem p{q,     k,          v,        head_stride, tables,
                  table_stride, starts, ends, num_seqs,    num_kv_heads,
                  group, dim,   page_size,   block_tokens, scale, probs, probs_stride};
  // tasks: (sequence, block) pairs, times the kv heads
  std::vector<int> first_block(num_seqs + 1, 0);
  for (int s = 0; s < num_seqs; ++s) {
    const int begin = starts ? starts[s] : 0;
    const int count = std::max(ends[s] - begin, 0);
    first_block[s + 1] = first_block[s] + (count + block_tokens - 1) / block_tokens;
  }
  const int num_blocks = first_block[num_seqs];
  std::vector<int> block_seq(num_blocks);
  for (int s = 0; s < num_seqs; ++s)
    for (int b = first_block[s]; b < first_block[s + 1]; ++b) block_seq[b] = s;
  const int part_stride = dim + 2;
  const int64_t head_parts = int64_t(group) * part_stride;
  // partials, kept per calling thread between calls: a fresh buffer of megabytes would
  // page-fault on every call
  static thread_local std::vector<float> parts;
  const size_t num_parts = size_t(num_blocks) * num_kv_heads * head_parts;
  if (parts.size() < num_parts) parts.resize(num_parts);
  float* const part_data = parts.data();  // the threads below see their own (empty) `parts`
  const int64_t num_tasks = int64_t(num_blocks) * num_kv_heads;
  const int threads = std::max(1, num_threads);
  const bool avx512 = allow_avx512 && dim % 16 == 0 && has_avx512();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < num_tasks; ++task) {
    const int block = int(task / num_kv_heads), head = int(task % num_kv_heads);
    const int seq = block_seq[block];
    const int t0 = (starts ? starts[seq] : 0) + (block - first_block[seq]) * block_tokens;
    const int t1 = std::min(t0 + block_tokens, ends[seq]);
    float* part = part_data + task * head_parts;
    if (kv_dtype == kBF16)
      attend_task<uint16_t>(p, avx512, seq, head, t0, t1, part);
    else
      attend_task<float>(p, avx512, seq, head, t0, t1, part);
  }
  // merge: query (seq, head, g) gathers its blocks' partials (stride between blocks)
  const int64_t num_queries = int64_t(num_seqs) * num_kv_heads * group;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t query = 0; query < num_queries; ++query) {
    const int g = int(query % group);
    const int head = int(query / group % num_kv_heads);
    const int seq = int(query / group / num_kv_heads);
    const int count = first_block[seq + 1] - first_block[seq];
    const float* first = part_data +
                         (int64_t(first_block[seq]) * num_kv_heads + head) * head_parts +
                         g * part_stride;
    merge(first, count, num_kv_heads * head_parts, dim, out + query * dim, lse + query);
  }
  if (probs != nullptr) {  // raw scores -> weights, once every lse is known
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t query = 0; query < num_queries; ++query) {
      const int seq = int(query / group / num_kv_heads);
      const int count = std::max(ends[seq] - (starts ? starts[seq] : 0), 0);
      float* row = probs + query * probs_stride;
      const float top = lse[query];
      for (int j = 0; j < count; ++j) row[j] = std::exp(row[j] - top);
    }
  }
  return 0;
}

}  // extern "C"
