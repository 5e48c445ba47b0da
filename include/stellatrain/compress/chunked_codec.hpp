// SPDX-License-Identifier: Apache-2.0
// The chunked low-bit codec: the top k of every fixed chunk of 2^b elements, chunk-local
// indices of b bits, values as 2-bit codes or 1-bit signs scaled per chunk, and error
// feedback of everything not sent, the quantisation error included (with an optional decay).
// The encoding of SparseLoCo-style and DisTrO-style exchanges; on the wire, a chunked section
// (`message_packer::add_chunked`, docs/wire-format.md).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/pack/detail/chunked_payload.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// The bits of one sent value.
enum class chunk_value_bits : std::uint8_t {
  /// The sign, with one scale per chunk: the mean magnitude of the chunk's sent values (the
  /// scale that minimises the squared error of sign(v) * s).
  one = 1,
  /// The sign and one magnitude bit, with two scales per chunk, low and high: the sent
  /// magnitudes split at the midpoint of their range, each half reconstructed as its mean.
  /// That is one Lloyd iteration from uniform levels: given the split, the means minimise the
  /// squared error, and unlike levels fixed by a standard deviation (SparseLoCo's) they need
  /// no clamping, since they always lie inside the range of what is sent.
  two = 2,
};

/// Options of `chunked_codec`.
struct chunked_codec_options {
  /// b: a chunk holds 2^b elements, 1 <= b <= 16 (the last chunk may be shorter).
  unsigned chunk_bits = 12;
  /// Elements sent per chunk, 1 <= k <= 2^b (a shorter last chunk sends all it has if fewer).
  std::uint32_t k = 64;
  chunk_value_bits bits = chunk_value_bits::two;
  /// The error feedback's decay beta, 0 < beta <= 1: feedback = beta * feedback + g before
  /// each selection (SparseLoCo uses 0.95; 1 keeps everything).
  float decay = 1.0f;
};

/// One tensor's encoded selection, as `chunked_codec::encode` writes it.
struct chunked_selection {
  std::uint64_t size = 0;   ///< elements of the tensor
  unsigned chunk_bits = 0;  ///< b
  std::uint32_t k = 0;      ///< elements sent per full chunk
  chunk_value_bits bits = chunk_value_bits::two;
  /// Chunk-local indices, ascending within each chunk, chunk after chunk (`kept(c)` each).
  std::vector<std::uint16_t> indices;
  /// One code per sent element in the order of `indices`, packed from the lowest bit of each
  /// byte: bit 0 the sign (1: negative), bit 1 (two-bit codes) the high magnitude.
  std::vector<std::uint8_t> codes;
  /// Per chunk: the scale (one-bit codes), or the low and the high magnitude (two-bit codes).
  std::vector<bf16> scales;

  [[nodiscard]] std::uint64_t chunk_elements() const noexcept {
    return std::uint64_t{1} << chunk_bits;
  }
  [[nodiscard]] std::uint64_t chunks() const noexcept {
    return chunk_bits == 0 ? 0 : (size + chunk_elements() - 1) >> chunk_bits;
  }
  /// Elements sent by chunk `c`.
  [[nodiscard]] std::uint64_t kept(std::uint64_t c) const noexcept {
    return std::min<std::uint64_t>(k, std::min(chunk_elements(), size - (c << chunk_bits)));
  }
  [[nodiscard]] unsigned scales_per_chunk() const noexcept {
    return bits == chunk_value_bits::two ? 2 : 1;
  }
  /// The payload in bits once packed: b bits per index, the codes, 16 bits per scale.
  [[nodiscard]] std::uint64_t payload_bits() const noexcept {
    return indices.size() * (chunk_bits + static_cast<unsigned>(bits)) + scales.size() * 16;
  }
  /// The selection as a wire section, for `message_packer::add_chunked` (a view: valid while
  /// the selection is unchanged).
  [[nodiscard]] chunked_section section() const noexcept {
    return {.dense_size = size,
            .chunk_bits = chunk_bits,
            .k = k,
            .code_bits = static_cast<unsigned>(bits),
            .indices = indices,
            .codes = codes,
            .scales = scales};
  }
};

/// Encodes a tensor with error feedback; decodes (adds) a selection into a dense tensor.
///
/// `encode(g, feedback, out)`: feedback = decay * feedback + g; in every chunk the k elements
/// of largest magnitude are chosen (ties go to the lower index, so every rank chooses alike);
/// their values are quantised and written to `out`; each chosen element's feedback becomes
/// what the receiver will not see (its value minus the dequantised one). A non-finite value
/// ranks above every finite one, makes its chunk's scales non-finite (sent as they are, as
/// `error_feedback_compressor` sends a non-finite value) and the feedback of every element
/// sent with a non-finite value is cleared, so that one overflow does not repeat forever.
/// A codec holds a workspace (kept between calls, 12 bytes per chunk element): one per thread.
class chunked_codec {
 public:
  explicit chunked_codec(const chunked_codec_options& options = {}) : options_(options) {
    check_options(options);
    keys_.resize(std::size_t{1} << options.chunk_bits);
    candidate_index_.resize(keys_.size() + 16);  // compress may store a vector's width
    candidates_.reserve(keys_.size());
  }

  /// Throws `invalid_argument` for options outside their ranges (`chunked_codec_options`).
  static void check_options(const chunked_codec_options& o) {
    if (o.chunk_bits < 1 || o.chunk_bits > 16) {
      throw_error(errc::invalid_argument, "chunked_codec: chunk_bits must be in [1, 16], got " +
                                              std::to_string(o.chunk_bits));
    }
    if (o.k < 1 || o.k > (std::uint64_t{1} << o.chunk_bits)) {
      throw_error(errc::invalid_argument, "chunked_codec: k must be in [1, 2^chunk_bits = " +
                                              std::to_string(std::uint64_t{1} << o.chunk_bits) +
                                              "], got " + std::to_string(o.k));
    }
    if (o.bits != chunk_value_bits::one && o.bits != chunk_value_bits::two) {
      throw_error(errc::invalid_argument, "chunked_codec: bits must be one or two");
    }
    if (!(o.decay > 0.0f && o.decay <= 1.0f)) {
      throw_error(errc::invalid_argument,
                  "chunked_codec: decay must be in (0, 1], got " + std::to_string(o.decay));
    }
  }

  [[nodiscard]] const chunked_codec_options& options() const noexcept { return options_; }

  /// Adds `g` into `feedback` (after the decay), selects, quantises into `out` and leaves in
  /// `feedback` what was not sent. Throws `invalid_argument` if the sizes differ.
  void encode(std::span<const float> g, std::span<float> feedback, chunked_selection& out) {
    if (g.size() != feedback.size()) {
      throw_error(errc::invalid_argument, "chunked_codec::encode: gradient of " +
                                              std::to_string(g.size()) + " elements, feedback of " +
                                              std::to_string(feedback.size()));
    }
    const unsigned b = options_.chunk_bits;
    out.size = g.size();
    out.chunk_bits = b;
    out.k = options_.k;
    out.bits = options_.bits;
    const std::uint64_t chunks = out.chunks();
    std::uint64_t total = 0;
    for (std::uint64_t c = 0; c < chunks; ++c) total += out.kept(c);
    out.indices.resize(total);
    out.codes.assign((total * static_cast<unsigned>(options_.bits) + 7) / 8, 0);
    out.scales.resize(chunks * out.scales_per_chunk());

    std::uint64_t written = 0;
    for (std::uint64_t c = 0; c < chunks; ++c) {
      const std::uint64_t begin = c << b;
      const std::uint64_t len = std::min<std::uint64_t>(std::uint64_t{1} << b, g.size() - begin);
      float* f = feedback.data() + begin;
      const std::uint64_t estimated = accumulate(g.data() + begin, f, len);
      const std::uint64_t kept = out.kept(c);
      select(len, kept, estimated, out.indices.data() + written);
      quantise(f, out, c, written, kept);
      written += kept;
    }
  }

  /// out[i] += weight * the dequantised value of every element `sel` holds. Throws
  /// `invalid_argument` for a selection whose parts disagree or an `out` of another size, and
  /// `out_of_range` for an index outside its chunk or not ascending; nothing is written then.
  static void decode_add(const chunked_selection& sel, std::span<float> out, float weight = 1.0f) {
    check(sel, out.size(), "chunked_codec::decode_add");
    for_each_pair(sel, [&](std::uint64_t, std::uint64_t i, float v) { out[i] += weight * v; });
  }

  /// Writes `sel` as (tensor index, value) pairs, ascending, to the front of `indices` and
  /// `values` (each at least `sel.indices.size()` long; `Index` wide enough for the tensor).
  /// Throws like `decode_add`, and `invalid_argument` for short outputs.
  template <class Index>
  static void decode_pairs(const chunked_selection& sel, std::span<Index> indices,
                           std::span<float> values) {
    check(sel, sel.size, "chunked_codec::decode_pairs");
    if (indices.size() < sel.indices.size() || values.size() < sel.indices.size()) {
      throw_error(errc::invalid_argument, "chunked_codec::decode_pairs: outputs shorter than the " +
                                              std::to_string(sel.indices.size()) + " pairs");
    }
    for_each_pair(sel, [&](std::uint64_t j, std::uint64_t i, float v) {
      indices[j] = static_cast<Index>(i);
      values[j] = v;
    });
  }

  /// Sets k, the elements sent per chunk, for the calls that follow (1 <= k <= 2^b).
  void set_k(std::uint32_t k) {
    chunked_codec_options o = options_;
    o.k = k;
    check_options(o);
    options_ = o;
  }

 private:
  // The value the receiver reconstructs from `code` (`low`/`high` equal for one-bit codes).
  static float dequantise(unsigned code, chunk_value_bits bits, float low, float high) noexcept {
    const float m = (bits == chunk_value_bits::two && (code & 2u)) ? high : low;
    return (code & 1u) ? -m : m;
  }

  static unsigned code_of(const chunked_selection& sel, std::uint64_t j) noexcept {
    const unsigned w = static_cast<unsigned>(sel.bits);
    const std::uint64_t bit = j * w;
    return (sel.codes[bit >> 3] >> (bit & 7)) & ((1u << w) - 1);
  }

  // Throws, naming `who`, unless `sel` is a whole selection of a tensor of `out_size`
  // elements: invalid_argument for sizes and parameters, out_of_range for indices outside their
  // chunk or not ascending.
  static void check(const chunked_selection& sel, std::uint64_t out_size, const char* who) {
    if (sel.size != out_size) {
      throw_error(errc::invalid_argument, std::string(who) + ": selection of " +
                                              std::to_string(sel.size) + " elements, output of " +
                                              std::to_string(out_size));
    }
    using kind = detail::chunked_fault::kind;
    if (const detail::chunked_fault f = detail::find_chunked_fault(sel.section())) {
      const bool index = f.what == kind::order || f.what == kind::range;
      throw_error(index ? errc::out_of_range : errc::invalid_argument,
                  std::string(who) + ": " + f.message);
    }
  }

  // f(j, tensor index, value) for every element of `sel` (checked), in order.
  template <class F>
  static void for_each_pair(const chunked_selection& sel, F&& f) {
    const unsigned per = sel.scales_per_chunk();
    std::uint64_t j = 0;
    for (std::uint64_t c = 0; c < sel.chunks(); ++c) {
      const float s0 = sel.scales[c * per].to_float();
      const float s1 = sel.scales[c * per + per - 1].to_float();
      for (std::uint64_t e = j + sel.kept(c); j < e; ++j) {
        f(j, (c << sel.chunk_bits) + sel.indices[j], dequantise(code_of(sel, j), sel.bits, s0, s1));
      }
    }
  }

  // feedback = decay * feedback + g over one chunk, the magnitude keys (the bits of |x|, which
  // order as the magnitudes do: a NaN above infinity above every finite value), and in the
  // same pass the candidates at or above the estimate (their count; see `select`).
  std::uint64_t accumulate(const float* g, float* f, std::uint64_t len) noexcept {
    using ops = detail::lane_ops<xsimd::default_arch>;
    using fbatch = typename ops::fbatch;
    using ibatch = typename ops::ibatch;
    const float decay = options_.decay;
    std::uint32_t* keys = keys_.data();
    std::uint32_t* cand = candidate_index_.data();
    const ibatch bound(static_cast<std::int32_t>(estimate_));  // keys are below 2^31
    const ibatch magnitude(0x7fffffff);
    const fbatch d(decay);
    const std::uint64_t body = len - len % ops::width;
    std::uint64_t n = 0;
    for (std::uint64_t i = 0; i < body; i += ops::width) {
      fbatch x = fbatch::load_unaligned(f + i);
      const fbatch y = fbatch::load_unaligned(g + i);
      x = decay == 1.0f ? x + y : d * x + y;
      x.store_unaligned(f + i);
      const ibatch k = detail::bitcast_lanes<std::int32_t>(x) & magnitude;
      k.store_unaligned(reinterpret_cast<std::int32_t*>(keys + i));
      n += ops::compress(ops::mask_bits(k >= bound),
                         ops::iota() + ibatch(static_cast<std::int32_t>(i)), cand + n);
    }
    for (std::uint64_t i = body; i < len; ++i) {
      f[i] = decay == 1.0f ? f[i] + g[i] : decay * f[i] + g[i];
      keys[i] = std::bit_cast<std::uint32_t>(f[i]) & 0x7fffffffu;
      cand[n] = static_cast<std::uint32_t>(i);
      n += keys[i] >= estimate_;
    }
    return n;
  }

  // The chunk-local indices of the `kept` largest keys, ties to the lower index, ascending.
  // The `estimated` candidates (gathered by `accumulate`) are the keys at or above an
  // estimate of the kept-th key, the previous chunk's kept-th key lowered by a margin:
  // neighbouring chunks of one tensor have alike statistics, so they are usually a few times
  // k, among which the k-th key is found exactly. With no estimate, or one that left fewer
  // than k or too many, the k-th key is searched over the whole chunk.
  void select(std::uint64_t len, std::uint64_t kept, std::uint64_t estimated,
              std::uint16_t* indices) {
    if (kept == len) {
      for (std::uint64_t i = 0; i < len; ++i) indices[i] = static_cast<std::uint16_t>(i);
      return;
    }
    const std::uint32_t* keys = keys_.data();
    std::uint32_t* cand = candidate_index_.data();
    const std::uint64_t most = std::max<std::uint64_t>(8 * kept, 256);
    if (estimate_ == 0) estimated = 0;
    std::uint64_t n = estimated;
    std::uint32_t t = 0;
    if (n < kept || n > most) {
      t = kth_key(len, kept);
      n = filter(len, t, cand);
    } else {
      candidates_.resize(n);
      for (std::uint64_t j = 0; j < n; ++j) candidates_[j] = keys[cand[j]];
      std::nth_element(candidates_.begin(),
                       candidates_.begin() + static_cast<std::ptrdiff_t>(kept - 1),
                       candidates_.end(), std::greater<>{});
      t = candidates_[kept - 1];
    }
    // The margin follows the chunks: wider after an estimate that left fewer than k, narrower
    // after one that left more than four times k (a 2^20 margin is an eighth of an octave).
    if (estimate_ != 0 && estimated < kept) {
      margin_ = std::min<std::uint32_t>(margin_ << 1, std::uint32_t{1} << 23);
    } else if (estimated > 4 * kept) {
      margin_ = std::max<std::uint32_t>(margin_ >> 1, std::uint32_t{1} << 16);
    }
    estimate_ = t > margin_ ? t - margin_ : 0;
    // Every key above t is taken; of the keys equal to t, the first ones up to k.
    std::uint64_t above = 0;
    for (std::uint64_t j = 0; j < n; ++j) above += keys[cand[j]] > t;
    std::uint64_t ties = kept - above;
    std::uint64_t m = 0;
    for (std::uint64_t j = 0; j < n; ++j) {
      const std::uint32_t key = keys[cand[j]];
      if (key > t || (key == t && ties > 0)) {
        ties -= key == t;
        indices[m++] = static_cast<std::uint16_t>(cand[j]);
      }
    }
  }

  // The indices of the keys at or above `t`, ascending, into `cand` (room for `len` + 16).
  std::uint64_t filter(std::uint64_t len, std::uint32_t t, std::uint32_t* cand) const noexcept {
    using ops = detail::lane_ops<xsimd::default_arch>;
    const std::uint32_t* keys = keys_.data();
    const typename ops::ibatch bound(static_cast<std::int32_t>(t));  // keys are below 2^31
    const std::uint64_t body = len - len % ops::width;
    std::uint64_t n = 0;
    std::uint64_t i = 0;
    for (; i < body; i += ops::width) {
      n +=
          ops::compress(ops::mask_bits(ops::load_words(keys + i) >= bound),
                        ops::iota() + typename ops::ibatch(static_cast<std::int32_t>(i)), cand + n);
    }
    for (; i < len; ++i) {
      cand[n] = static_cast<std::uint32_t>(i);
      n += keys[i] >= t;
    }
    return n;
  }

  // The kept-th largest key of the chunk: a histogram of the top 11 bits walked down from the
  // largest key's bin, then the candidates of the bin that holds it, in order.
  std::uint32_t kth_key(std::uint64_t len, std::uint64_t kept) {
    const std::uint32_t* keys = keys_.data();
    std::fill(std::begin(hist_), std::end(hist_), 0u);
    std::uint32_t top = 0;
    for (std::uint64_t i = 0; i < len; ++i) {
      ++hist_[keys[i] >> 20];
      top = std::max(top, keys[i]);
    }
    std::uint64_t need = kept;
    std::uint32_t bin = top >> 20;
    while (hist_[bin] < need) need -= hist_[bin--];
    candidates_.clear();
    for (std::uint64_t i = 0; i < len; ++i) {
      if ((keys[i] >> 20) == bin) candidates_.push_back(keys[i]);
    }
    std::nth_element(candidates_.begin(),
                     candidates_.begin() + static_cast<std::ptrdiff_t>(need - 1), candidates_.end(),
                     std::greater<>{});
    return candidates_[need - 1];
  }

  // The codes and scales of chunk `c`, and the feedback of its sent elements.
  void quantise(float* f, chunked_selection& out, std::uint64_t c, std::uint64_t first,
                std::uint64_t kept) noexcept {
    const std::uint16_t* idx = out.indices.data() + first;
    const unsigned per = out.scales_per_chunk();
    float lo = 0.0f;
    float hi = 0.0f;
    float split = 0.0f;
    if (out.bits == chunk_value_bits::one) {
      double sum = 0;
      for (std::uint64_t j = 0; j < kept; ++j) sum += std::fabs(f[idx[j]]);
      lo = hi = bf16(static_cast<float>(sum / static_cast<double>(kept))).to_float();
      out.scales[c] = bf16(lo);
    } else {
      float mn = std::fabs(f[idx[0]]);
      float mx = mn;
      for (std::uint64_t j = 1; j < kept; ++j) {
        const float m = std::fabs(f[idx[j]]);
        mn = std::min(mn, m);
        mx = std::max(mx, m);
      }
      split = mn + (mx - mn) * 0.5f;
      double sum_lo = 0, sum_hi = 0;
      std::uint64_t n_hi = 0;
      for (std::uint64_t j = 0; j < kept; ++j) {
        const float m = std::fabs(f[idx[j]]);
        const bool high = m > split;
        (high ? sum_hi : sum_lo) += m;
        n_hi += high;
      }
      const std::uint64_t n_lo = kept - n_hi;
      // n_lo >= 1: the smallest magnitude is never above the split (a NaN makes every
      // comparison false, so it lands in the low half and makes that scale a NaN).
      lo = bf16(static_cast<float>(sum_lo / static_cast<double>(n_lo))).to_float();
      hi = n_hi ? bf16(static_cast<float>(sum_hi / static_cast<double>(n_hi))).to_float() : lo;
      out.scales[c * per] = bf16(lo);
      out.scales[c * per + 1] = bf16(hi);
    }
    const unsigned w = static_cast<unsigned>(out.bits);
    for (std::uint64_t j = 0; j < kept; ++j) {
      float& x = f[idx[j]];
      const unsigned code = (std::signbit(x) ? 1u : 0u) |
                            ((out.bits == chunk_value_bits::two && std::fabs(x) > split) ? 2u : 0u);
      const std::uint64_t bit = (first + j) * w;
      out.codes[bit >> 3] |= static_cast<std::uint8_t>(code << (bit & 7));
      const float sent = dequantise(code, out.bits, lo, hi);
      x = std::isfinite(x) && std::isfinite(sent) ? x - sent : 0.0f;
    }
  }

  chunked_codec_options options_;
  std::vector<std::uint32_t> keys_;
  std::vector<std::uint32_t> candidate_index_;
  std::vector<std::uint32_t> candidates_;
  std::uint32_t estimate_ = 0;  // a key at most the next chunk's k-th, probably (0: none)
  std::uint32_t margin_ = std::uint32_t{1} << 20;
  std::uint32_t hist_[2048] = {};
};

}  // namespace stellatrain
