"""The shape letters every specjax module uses in docstrings and comments.

One letter, one meaning, across the library (module docstrings cite this
glossary and list the letters they use):

- B batch rows;
- T tokens in one forward (a chunk: 1 to decode, γ+1 to verify, a prompt
  piece to prefill);
- P padded prompt width (a power-of-two bucket);
- S cache size, positions per row;
- N max new tokens, N_cap its static cap; W output buffer width;
- C tokens emitted per step (1 autoregressive, γ+1 speculative);
- M most speculative steps a generation can take;
- G = γ, draft tokens per speculative step;
- L layers; E hidden size; F MLP hidden size;
- H query heads; K key/value heads; R = H / K query heads per key/value
  head; D head dim;
- V vocabulary size;
- Y end-of-sequence ids;
- Q automaton states (of stop strings, `specjax.stops`, or a grammar,
  `specjax.grammar`), A a grammar's token classes (both padded);
- X rows of one matrix product (B·T flattened), I its input features, O its
  output features.

Device meshes (`specjax.sharding`) have two named axes: `DATA` splits the
batch B, `MODEL` splits heads, MLP columns and the vocabulary.
"""

DATA = "data"
MODEL = "model"


def mesh_axis(name: str | None, size: int, mesh) -> str | None:
  """`name` if that mesh axis divides a dimension of `size`, else None (the
  dimension stays whole): the one divisibility rule of every sharding."""
  return name if name and size % mesh.shape[name] == 0 else None


LETTERS = {
    "B": "batch rows",
    "T": "tokens in one forward",
    "P": "padded prompt width",
    "S": "cache size",
    "N": "max new tokens",
    "N_cap": "static cap on max new tokens",
    "W": "output buffer width",
    "C": "tokens emitted per step",
    "M": "most speculative steps",
    "G": "gamma, draft tokens per step",
    "L": "layers",
    "E": "hidden size",
    "F": "MLP hidden size",
    "H": "query heads",
    "K": "key/value heads",
    "R": "query heads per key/value head",
    "D": "head dim",
    "V": "vocabulary size",
    "Y": "end-of-sequence ids",
    "Q": "automaton states (stop strings, grammars)",
    "A": "token classes of a grammar",
    "X": "rows of a matrix product",
    "I": "input features",
    "O": "output features",
}
