// Loaders and writers of the model files kvevict's reference decoder reads: GGUF (llama.cpp),
// safetensors + Hugging Face config.json, and llama2.c checkpoints (+ optional tokenizer.bin).
//
// Every loader reads the whole file into one 64-byte-aligned buffer and bounds-checks every field
// against it before using it: a malformed or hostile file throws kvevict::Error naming the format
// and the problem, and no allocation is ever sized from a field that was not first checked
// against the bytes that remain. f32/f16/bf16 weights are used in place (Model::storage keeps
// the file buffer alive; a tensor whose offset is not a multiple of its element size is copied
// into an aligned buffer), so WeightMatrix::data is always aligned to its element size. GGUF
// Matrices keep their file's type in memory (Q8_0 and Q4_0 too). Norm vectors are converted to f32.
//
// RoPE layouts: GGUF and llama2.c Q/K rows expect interleaved RoPE, safetensors (Hugging Face)
// rows expect half_split. Loaders set config.rope_layout to the file's layout and never permute;
// writers permute Q/K rows per head when the model's layout differs from the target format's
// (see permute_rope_rows).
//
// Tokenizers by format:
//   GGUF         tokenizer.ggml.model "llama" => SentencePiece (tokenizer.ggml.tokens / scores /
//                token_type, bos/eos ids); "kvevict-bytes" => byte-level with
//                tokenizer.ggml.bos_token_id / eos_token_id and kvevict.anchor_token_id; key absent
//                => byte-level with whatever bos/eos ids are given. Other models (e.g. "gpt2")
//                are rejected.
//   safetensors  config.json key "kvevict_tokenizer":
//                  "bytes"          byte-level; ids from "bos_token_id", "eos_token_id" and
//                                   "anchor_token_id" (each optional; an integer, or null);
//                  "sentencepiece"  pieces in "kvevict_tokenizer_pieces" (strings), scores in
//                                   "kvevict_tokenizer_scores" (numbers), types in
//                                   "kvevict_tokenizer_types" (integers, optional), same ids.
//                Absent => byte-level fallback with the ids above: Hugging Face tokenizer.json /
//                tokenizer.model are not read (convert such models to GGUF for text I/O).
//   llama2.c     tokenizer.bin (llama2.c's format: int32 max_token_length, then per token f32
//                score, int32 length, bytes) when a path is given, or when load_model finds a
//                "tokenizer.bin" beside the checkpoint; BOS = 1, EOS = 2 as in run.c. Otherwise a
//                byte-level fallback (ids 0..255 = bytes, no BOS/EOS).
// In every byte-level tokenizer the anchor id is the AnLLM "<AC>" token; a SentencePiece
// vocabulary's anchor is the piece "<AC>" when it has one (or GGUF's kvevict.anchor_token_id).
//
// Tokenizer behaviour (tokenizer.cpp):
//   byte-level     encode: one id per byte (an error if the byte is >= vocab_size); decode: ids
//                  0..255 are their byte, every other id in the vocabulary decodes to "".
//   SentencePiece  encode as llama.cpp does for Llama vocabularies: "▁" dummy prefix (not for
//                  empty text), spaces -> "▁", one symbol per UTF-8 character, then repeatedly
//                  merge the adjacent pair whose concatenation is a piece with the highest score
//                  (ties: leftmost); a final symbol that is no piece becomes its byte pieces
//                  <0xXX>, or <unk> when those are missing. Control, unknown, unused and byte
//                  pieces are never matched from text. Special tokens in the text are not parsed.
//                  decode: control / unused pieces -> "", byte pieces -> their byte, others ->
//                  their text with "▁" -> " " (the leading space of the first word is kept: strip
//                  it if wanted), ids past the pieces (padding rows) -> "".
//                  GGUF's tokenizer.ggml.add_space_prefix / add_bos_token are not read (Llama's
//                  defaults, true, are assumed; add_bos is the caller's choice).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <kvevict/model/model.hpp>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::model {

// ---------------------------------------------------------------------------------------------
// Loaders. The span overloads copy the bytes into an aligned buffer the model then owns.
// ---------------------------------------------------------------------------------------------

[[nodiscard]] Model load_gguf(const std::filesystem::path& path);
[[nodiscard]] Model load_gguf(std::span<const std::byte> file);

/// `path` is a .safetensors file with config.json in the same directory, or a directory holding
/// model.safetensors and config.json. Sharded checkpoints are not supported.
[[nodiscard]] Model load_safetensors(const std::filesystem::path& path);
[[nodiscard]] Model load_safetensors(std::span<const std::byte> file, std::string_view config_json);

/// run.c's checkpoint format ("legacy", version 0). An empty tokenizer path (or span) selects the
/// byte-level fallback.
[[nodiscard]] Model load_llama2c(const std::filesystem::path& path,
                                 const std::filesystem::path& tokenizer_path = {});
[[nodiscard]] Model load_llama2c(std::span<const std::byte> checkpoint,
                                 std::span<const std::byte> tokenizer_bin = {});
/// A llama2.c tokenizer.bin holding exactly `vocab_size` tokens, as a SentencePiece tokenizer
/// (spaces in pieces become "▁" again; types are inferred: 0 unknown, 1/2 control, <0xXX> byte).
[[nodiscard]] Tokenizer read_llama2c_tokenizer(std::span<const std::byte> file, int vocab_size);

// ---------------------------------------------------------------------------------------------
// Writers. serialize_* build the file in memory (tests mutate those bytes); write_* store it.
// ---------------------------------------------------------------------------------------------

struct GgufWriteOptions {
  /// Store every weight matrix whose column count is a multiple of 32 as Q8_0 (the others, and
  /// the norms, keep their dtype). Per block of 32: scale d = the smallest f16 >= max|x| / 127,
  /// q = round(x / d), so |x - q d| <= d / 2.
  bool quantize_q8_0 = false;
  /// The same as Q4_0 (llama.cpp's reference quantiser; see quant.hpp). Not with quantize_q8_0.
  bool quantize_q4_0 = false;
  /// Tensor data alignment (a power of two); written as general.alignment when not 32.
  std::uint32_t alignment = 32;
};

[[nodiscard]] std::vector<std::byte> serialize_gguf(const Model& model,
                                                    const GgufWriteOptions& options = {});
void write_gguf(const Model& model, const std::filesystem::path& path,
                const GgufWriteOptions& options = {});

struct SafetensorsFiles {
  std::vector<std::byte> tensors;  ///< model.safetensors
  std::string config_json;         ///< config.json
};
/// Matrices keep their dtype, norms are written as F32. Tensors are ordered by element size so
/// every one is aligned to it, with no gaps (as the safetensors spec requires).
[[nodiscard]] SafetensorsFiles serialize_safetensors(const Model& model);
/// Writes `dir`/model.safetensors and `dir`/config.json (creating `dir`).
void write_safetensors(const Model& model, const std::filesystem::path& dir);

/// f32 checkpoint in run.c's layout; requires what run.c hard-codes: rope_theta 10000,
/// norm_eps 1e-5, full-head rotary, and a positive context_length (seq_len).
[[nodiscard]] std::vector<std::byte> serialize_llama2c(const Model& model);
void write_llama2c(const Model& model, const std::filesystem::path& path);
/// tokenizer.bin for a SentencePiece tokenizer ("▁" written as a space, as llama2.c's exporter
/// does).
[[nodiscard]] std::vector<std::byte> serialize_llama2c_tokenizer(const Tokenizer& tokenizer);
void write_llama2c_tokenizer(const Tokenizer& tokenizer, const std::filesystem::path& path);

// ---------------------------------------------------------------------------------------------
// RoPE row permutation.
// ---------------------------------------------------------------------------------------------

/// A copy of Q or K projection `matrix` ([heads * head_dim, cols]) with the rows of each head
/// reordered so RoPE with layout `to` rotates the same pairs of features that `from` rotated.
/// Within each head only the first `rotary_dim` rows move (r = rotary_dim):
///   half_split -> interleaved: new row 2i = old row i, new row 2i+1 = old row i + r/2;
///   interleaved -> half_split: the inverse.
/// Rows are moved as raw bytes (bit-exact, any dtype). The new bytes are appended to `storage`.
/// from == to returns `matrix` unchanged.
[[nodiscard]] WeightMatrix permute_rope_rows(const WeightMatrix& matrix, int heads, int head_dim,
                                             int rotary_dim, RopeLayout from, RopeLayout to,
                                             std::vector<std::shared_ptr<const void>>& storage);

// ---------------------------------------------------------------------------------------------
// Shared by the format implementations (not part of the loaders' contract).
// ---------------------------------------------------------------------------------------------
namespace detail {

/// `text` in single quotes, for error messages.
[[nodiscard]] std::string in_quotes(std::string_view text);

/// Bytes in a 64-byte-aligned heap buffer.
struct AlignedBytes {
  std::shared_ptr<std::byte[]> owner;
  std::size_t size = 0;

  [[nodiscard]] std::byte* data() const { return owner.get(); }
  [[nodiscard]] std::span<const std::byte> span() const { return {owner.get(), size}; }
};
[[nodiscard]] AlignedBytes allocate_aligned(std::size_t size);
[[nodiscard]] AlignedBytes copy_aligned(std::span<const std::byte> bytes);
/// The whole file; `format` prefixes error messages ("GGUF: cannot open ...").
[[nodiscard]] AlignedBytes read_file(const std::filesystem::path& path, std::string_view format);
void write_file(const std::filesystem::path& path, std::span<const std::byte> bytes,
                std::string_view format);

/// Little-endian cursor over file bytes; every read is bounds-checked and a short read throws
/// "<format>: truncated file: ...".
class ByteReader {
 public:
  ByteReader(std::span<const std::byte> bytes, std::string_view format)
      : bytes_(bytes), format_(format) {}

  [[nodiscard]] std::size_t position() const { return position_; }
  [[nodiscard]] std::size_t remaining() const { return bytes_.size() - position_; }
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  [[nodiscard]] std::string_view format() const { return format_; }

  std::uint8_t u8(std::string_view what);
  std::uint16_t u16(std::string_view what);
  std::uint32_t u32(std::string_view what);
  std::uint64_t u64(std::string_view what);
  std::int32_t i32(std::string_view what);
  float f32(std::string_view what);
  double f64(std::string_view what);
  /// `length` bytes (checked against what remains) as a view into the file.
  std::span<const std::byte> bytes(std::uint64_t length, std::string_view what);
  std::string_view string(std::uint64_t length, std::string_view what);
  void skip(std::uint64_t length, std::string_view what);
  void seek(std::size_t position) { position_ = position; }

 private:
  void need(std::uint64_t length, std::string_view what) const;
  std::span<const std::byte> bytes_;
  std::string_view format_;
  std::size_t position_ = 0;
};

/// Appends little-endian values.
class ByteWriter {
 public:
  void u8(std::uint8_t value) { append(&value, 1); }
  void u16(std::uint16_t value) { append(&value, 2); }
  void u32(std::uint32_t value) { append(&value, 4); }
  void u64(std::uint64_t value) { append(&value, 8); }
  void i32(std::int32_t value) { append(&value, 4); }
  void f32(float value) { append(&value, 4); }
  void f64(double value) { append(&value, 8); }
  void bytes(std::span<const std::byte> data) { append(data.data(), data.size()); }
  void string(std::string_view text) { append(text.data(), text.size()); }
  void pad_to(std::size_t alignment, std::byte fill = std::byte{0});
  [[nodiscard]] std::size_t size() const { return buffer_.size(); }
  [[nodiscard]] std::vector<std::byte>& buffer() { return buffer_; }

 private:
  void append(const void* data, std::size_t size);
  std::vector<std::byte> buffer_;
};

/// Which weight of a Llama model a tensor is, and its shape in PyTorch order ([rows, cols] for
/// matrices, [dim] for norms).
enum class TensorRole : std::uint8_t {
  token_embedding,
  attention_norm,
  wq,
  wk,
  wv,
  wo,
  ffn_norm,
  w_gate,
  w_up,
  w_down,
  final_norm,
  output,
};
inline constexpr TensorRole kLayerRoles[] = {TensorRole::attention_norm,
                                             TensorRole::wq,
                                             TensorRole::wk,
                                             TensorRole::wv,
                                             TensorRole::wo,
                                             TensorRole::ffn_norm,
                                             TensorRole::w_gate,
                                             TensorRole::w_up,
                                             TensorRole::w_down};
[[nodiscard]] bool is_norm(TensorRole role);
[[nodiscard]] std::vector<std::int64_t> expected_shape(const ModelConfig& config, TensorRole role);
[[nodiscard]] WeightMatrix& matrix_of(Model& model, TensorRole role, int layer);
[[nodiscard]] const WeightMatrix& matrix_of(const Model& model, TensorRole role, int layer);
[[nodiscard]] std::vector<float>& norm_of(Model& model, TensorRole role, int layer);
[[nodiscard]] const std::vector<float>& norm_of(const Model& model, TensorRole role, int layer);
/// "[a, b]" for messages.
[[nodiscard]] std::string shape_string(std::span<const std::int64_t> shape);

/// A matrix over `bytes` (already bounds-checked, rows * cols * dtype_size long): used in place
/// when `bytes` is aligned to the element size, else copied into an aligned buffer appended to
/// `model.storage`.
[[nodiscard]] WeightMatrix matrix_view(Model& model, std::span<const std::byte> bytes, DType dtype,
                                       std::int64_t rows, std::int64_t cols);
/// `value` as f32; kvevict::Error naming `what` when a finite value is beyond the f32 range (the
/// plain conversion would be undefined behaviour). NaN and infinities pass through.
[[nodiscard]] float narrow_to_f32(double value, std::string_view what);
/// `count` values of `dtype` (little-endian) as f32.
[[nodiscard]] std::vector<float> to_f32(std::span<const std::byte> bytes, DType dtype,
                                        std::size_t count);
/// The matrix's bytes converted to `dtype` (raw copy when it already has that dtype).
[[nodiscard]] std::vector<std::byte> matrix_bytes_as(const WeightMatrix& matrix, DType dtype);

/// Permutes the model's Q and K rows in place (into new buffers) from config.rope_layout to
/// `target`, and sets config.rope_layout. Used by writers on a shallow copy of the model.
void convert_rope_layout(Model& model, RopeLayout target);
/// Checks the configuration (ModelConfig::validate, prefixed with the format) and the tokenizer's
/// consistency with it; fills tokenizer.vocab_size.
void finish_model(Model& model, std::string_view format);

/// A tensor's bytes in a file's data section: [begin, end).
struct TensorBytes {
  std::string_view name;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};
/// Throws "<format>: tensors 'a' and 'b' overlap ..." unless no two non-empty ranges share a byte:
/// two tensors over the same bytes would alias each other (an untied classifier that is the
/// embedding, read as another dtype).
void require_disjoint(std::vector<TensorBytes> tensors, std::string_view format);

/// Tokenizer helpers (tokenizer.cpp).
/// For "<0xXX>" returns the byte value, else -1.
[[nodiscard]] int byte_piece_value(std::string_view piece);
/// Types for pieces that came without them: bos/eos control, unk_id unknown, <0xXX> byte, rest
/// normal.
[[nodiscard]] std::vector<std::int32_t> infer_piece_types(const std::vector<std::string>& pieces,
                                                          std::int32_t bos_id, std::int32_t eos_id,
                                                          std::int32_t unk_id);
/// Id of the piece spelled exactly `text`, or -1.
[[nodiscard]] std::int32_t find_piece(const Tokenizer& tokenizer, std::string_view text);

}  // namespace detail
}  // namespace kvevict::model
