"""What a compiled program reads from device memory, counted in its HLO.

XLA's `cost_analysis()` is one number per module, and two of its habits make
it wrong for decoding programs (tests/test_aot.py checks each on a known
program, compiled for TPU):

- a `while` body is counted once, whatever its trip count: a scan over L
  layers reports one layer's bytes;
- on TPU an operand prefetched into on-chip memory (a `copy-start` to
  memory space S(1)) is counted at the copy and again at its reader: an
  8-row product of a 32 MiB matrix reports 160 MiB.

`count` walks the optimised HLO text instead: every top-level instruction
reads its operands and writes its result where they live in device memory
(HBM: no memory space, or S(0)); a fused computation that only slices an
operand reads the slice; an in-place update writes the update; a `while`
body counts once per iteration, with its trip count read from the loop's
condition (for a loop that may stop early, such as drafting, its bound); a
`conditional` counts its dearest branch (or, in the name scopes given,
its cheapest: the greedy one of `sampling.probabilities`). Collectives
are counted the same way. An asynchronous operation moves its bytes at
its `*-start`.

The walk also counts the multiply-adds of every `dot` and `convolution`
(TPU writes a matrix product as a convolution), fused or not, as 2 FLOPs
each, loops run their trip counts; `HloCount.roofline_s` prices each
top-level kernel at the slower of its bytes and its FLOPs.

The same walk reads GPU HLO (XLA's CUDA compiler): there a loop's
condition is a fusion, gemms are Triton fusions or cuBLAS calls (whose
workspace result is scratch, not written), and small all-reduces are
Triton fusions (`"kind":"__triton_collective"`), counted as collectives.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

__all__ = ["HloCount", "count"]

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8, "s4": 0.5, "u4": 0.5, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
# Opcodes that move no data of their own.
# (An asynchronous `*-done` moves none either: its `*-start` is counted.)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
         "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "domain"}
_SLICES = {"dynamic-slice", "slice", "gather"}
# Element-preserving operations a fusion evaluates on demand.
_RELAYOUTS = {"copy", "convert", "bitcast", "reshape", "bitcast-convert"}
# GPU library calls whose last result is a scratch buffer.
_WORKSPACE = re.compile(r'custom_call_target="__(cublas|cudnn)')
# A collective XLA's CUDA compiler emits as a (Triton) fusion.
_GPU_COLLECTIVE = '"kind":"__triton_collective"'
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter",
                "collective-permute", "all-to-all")


@dataclasses.dataclass
class _Instr:
  name: str
  type: str
  opcode: str
  args: str  # the text inside the parentheses
  operands: list[str]
  attrs: str  # the text after them
  root: bool


@dataclasses.dataclass(frozen=True)
class HloCount:
  """Totals over one run of a program.

  Attributes:
    hbm_bytes: bytes read and written in device memory.
    hbm_written: the part of them written (a step that copied a weight
      would write as much as it reads of it).
    collectives: collective operations executed (all-reduce, all-gather,
      reduce-scatter, collective-permute, all-to-all).
    instructions: HLO instructions in the optimised module (all
      computations, fused ones included).
    fusions: fusion instructions.
    while_loops: `while` instructions.
    unknown_trips: `while` loops whose trip count the condition does not
      fix (counted once; a generation loop that runs to EOS).
    largest: the instructions that move the most bytes, as (bytes over
      the run, opcode, the JAX operation it came from), largest first.
    flops: FLOPs of the matrix products (2 per multiply-add).
    kernels: (runs, HBM bytes, FLOPs) of each top-level instruction that
      moves bytes or computes, but for `argument_copies`.
    argument_copies: bytes of the entry's copies of its own arguments (in
      `hbm_bytes`): a relayout of weights that a step compiled alone
      makes, and that a whole generation has been seen to fuse into the
      products reading them.
  """

  hbm_bytes: float
  hbm_written: float
  collectives: float
  instructions: int
  fusions: int
  while_loops: int
  unknown_trips: int
  largest: tuple[tuple[float, str, str], ...] = ()
  flops: float = 0.0
  kernels: tuple[tuple[float, float, float], ...] = ()
  argument_copies: float = 0.0

  def bound_s(self, bandwidth: float, flops: float
              ) -> tuple[float, float]:
    """(seconds in kernels bound by their bytes, seconds in kernels bound
    by their FLOPs) of one run on a chip of `bandwidth` HBM bytes/s and
    `flops` FLOP/s: each kernel takes the slower of the two (no overlap
    between kernels, no launch cost; without `argument_copies`)."""
    memory = compute = 0.0
    for n, b, f in self.kernels:
      if f / flops > b / bandwidth:
        compute += n * f / flops
      else:
        memory += n * b / bandwidth
    return memory, compute

  def roofline_s(self, bandwidth: float, flops: float) -> float:
    """Seconds of one run: both parts of `bound_s`."""
    return sum(self.bound_s(bandwidth, flops))


def _split_type(rest: str) -> tuple[str, str]:
  """'TYPE opcode(...)...' -> (TYPE, 'opcode(...)...'); tuple types nest."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 2:]
  head, _, tail = rest.partition(" ")
  return head, tail


def _split_tuple(typ: str) -> list[str]:
  """'(A, B{...}, C)' -> ['A', 'B{...}', 'C'] (top-level elements)."""
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(typ):
    depth += ch in "({["
    depth -= ch in ")}]"
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(typ[start:i].strip())
      start = i + 1
  return parts


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
  """Computations (name -> instructions) and the entry's name."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = comps.setdefault(header.group(2), [])
      if header.group(1):
        entry = header.group(2)
      continue
    if current is None or " = " not in line or not line.startswith("  "):
      continue
    lhs, _, rest = line.strip().partition(" = ")
    name = lhs.removeprefix("ROOT ").lstrip("%")
    typ, call = _split_type(rest)
    opcode, _, args = call.partition("(")
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        end = i
        break
    operands = re.findall(r"%([\w.\-]+)", args[:end])
    current.append(_Instr(name, typ, opcode, args[:end], operands,
                          args[end + 1:], lhs.startswith("ROOT ")))
  if entry is None:
    raise ValueError("No ENTRY computation in the HLO text.")
  return comps, entry


def _bytes(typ: str, hbm_only: bool = True) -> float:
  """Bytes of a (tuple) type; with `hbm_only`, of its parts in HBM."""
  total = 0.0
  for dtype, dims, layout in _ARRAY.findall(typ):
    space = re.search(r"S\((\d+)\)", layout or "")
    if hbm_only and space and space.group(1) != "0":
      continue
    size = math.prod(int(d) for d in dims.split(",") if d)
    total += size * _BYTES.get(dtype, 4)
  return total


def _dims(typ: str) -> list[int] | None:
  """Dimensions of the first array in a type (None: no array)."""
  match = _ARRAY.search(typ)
  return [int(d) for d in match.group(2).split(",") if d] if match else None


def _elements(typ: str) -> int:
  """Elements of the first array in a type."""
  dims = _dims(typ)
  return 0 if dims is None else math.prod(dims)


def _product_flops(instr: _Instr, names: dict[str, _Instr]) -> float:
  """2 x the multiply-adds of a `dot` or `convolution`: its result's
  elements times the terms each sums (a dot's contracting dimensions; a
  convolution's kernel elements per output feature)."""
  out = _elements(instr.type)
  lhs = _dims(names[instr.operands[0]].type)
  if instr.opcode == "dot":
    match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    terms = math.prod(lhs[int(i)] for i in match.group(1).split(",")
                      if i) if match else 1
    return 2.0 * out * terms
  rhs = _dims(names[instr.operands[1]].type)
  labels = re.search(r"dim_labels=(\w*)_(\w*)->(\w*)", instr.attrs)
  if not labels or len(labels.group(2)) != len(rhs):
    raise ValueError(f"Unreadable convolution: {instr.name} {instr.attrs}")
  in_labels, kernel_labels, out_labels = labels.groups()
  terms = math.prod(rhs) / rhs[kernel_labels.index("o")]
  window = re.search(r"window=\{([^}]*)\}", instr.attrs)
  if window:
    fields = dict(f.split("=") for f in window.group(1).split())
    out_dims = _dims(instr.type)
    for k, size in enumerate(fields["size"].split("x")):
      terms *= _real_taps(
          int(size), lhs[in_labels.index(str(k))],
          out_dims[out_labels.index(str(k))],
          *(int(fields[f].split("x")[k]) if f in fields else 1
            for f in ("stride", "lhs_dilate", "rhs_dilate")),
          int(fields["pad"].split("x")[k].split("_")[0])
          if "pad" in fields else 0)
  return 2.0 * out * terms


def _real_taps(size: int, inputs: int, outputs: int, stride: int,
               dilate: int, spread: int, pad: int) -> float:
  """The fraction of a convolution window's taps, along one dimension,
  that land on an input element, over all outputs: padding and input
  dilation (holes between the inputs) leave the others on zeros. (TPU
  writes a batched matrix product as a window over an input dilated by
  the window's size, one tap of which is real; a product per head, as a
  window padded by its size less one.)"""
  at = (np.arange(outputs)[:, None] * stride
        + np.arange(size)[None, :] * spread - pad)
  real = (at >= 0) & (at <= (inputs - 1) * dilate) & (at % dilate == 0)
  return float(real.mean())


def _called(attrs: str, key: str) -> list[str]:
  """The computations an instruction names in attribute `key`
  (`calls=%f` or `branch_computations={%a, %b}`)."""
  match = re.search(key + r"=(\{[^}]*\}|%[\w.\-]+)", attrs)
  if not match:
    return []
  return [n.strip().lstrip("%") for n in match.group(1).strip("{}").split(",")
          if n.strip()]


class _Counter:
  """Walks one module's computations."""

  def __init__(self, text: str, cheapest: tuple[str, ...] = ()):
    self.comps, self.entry = _parse(text)
    self.cheapest = set(cheapest)
    self.by_name = {c: {i.name: i for i in instrs}
                    for c, instrs in self.comps.items()}
    # fused computation -> (the computation, the fusion that calls it)
    self.fused_by = {inner: (c, i) for c, instrs in self.comps.items()
                     for i in instrs if i.opcode == "fusion"
                     for inner in _called(i.attrs, "calls")}
    self.unknown_trips = 0
    self.moved = {}  # (opcode, JAX op) -> bytes over the run
    self.scale = 1.0  # runs of the computation being walked
    self.argument_copies = 0.0

  def fused_flops(self, comp: str) -> float:
    """Matrix-product FLOPs of one run of fused computation `comp`."""
    names, total = self.by_name[comp], 0.0
    for instr in self.comps[comp]:
      if instr.opcode in ("dot", "convolution"):
        total += _product_flops(instr, names)
      elif instr.opcode == "fusion":
        total += sum(map(self.fused_flops, _called(instr.attrs, "calls")))
    return total

  def param_read(self, comp: str, index: int, full: float) -> float:
    """Bytes a fused computation `comp` reads of its parameter `index`,
    whose whole is `full` bytes (`_needed`)."""
    param = next((i.name for i in self.comps[comp] if i.opcode == "parameter"
                  and i.args.strip() == str(index)), None)
    return full if param is None else full * self._needed(comp, param, 1.0)

  def _needed(self, comp: str, name: str, of_root: float) -> float:
    """The fraction of value `name`'s elements that fused computation
    `comp` reads, `of_root` being the fraction of its result read: a
    fusion computes elements on demand, so a value that is only sliced,
    updated in place, or relaid out, converted or reshaped on its way to
    a slice (a nested fusion included) is read only where the slice is."""
    instr = self.by_name[comp][name]
    size = _elements(instr.type)
    total = of_root if instr.root else 0.0
    for user in self.comps[comp]:
      if name not in user.operands:
        continue
      if user.opcode in _SLICES and user.operands[0] == name:
        total += _elements(user.type) / max(size, 1)
      elif user.opcode == "dynamic-update-slice" and (
          user.operands[0] == name):
        continue  # updated in place
      elif user.opcode in _RELAYOUTS and _elements(user.type) == size:
        total += self._needed(comp, user.name, of_root)
      elif user.opcode == "fusion":
        (inner,) = _called(user.attrs, "calls")
        used = self._needed(comp, user.name, of_root)
        for k, operand in enumerate(user.operands):
          if operand == name:
            param = next(i.name for i in self.comps[inner]
                         if i.opcode == "parameter"
                         and i.args.strip() == str(k))
            total += self._needed(inner, param, used)
      elif user.opcode == "tuple" and user.root:
        total += of_root
      else:
        return 1.0
      if total >= 1.0:
        return 1.0
    return total

  def written(self, comp: str) -> float:
    """Bytes a fusion writes to HBM: its results, or only the update of
    a result that updates an operand in place."""
    names = self.by_name[comp]
    root = next(i for i in self.comps[comp] if i.root)
    parts = [names[o] for o in root.operands] if (
        root.opcode == "tuple") else [root]
    total = 0.0
    for part in parts:
      if part.opcode == "dynamic-update-slice":
        if _bytes(part.type):
          total += _bytes(names[part.operands[1]].type, hbm_only=False)
      else:
        total += _bytes(part.type)
    return total

  def _terms(self, comp: str, instr: _Instr) -> list[tuple[str, _Instr]]:
    """The terms of a loop condition's `and`s, with the computation each
    lies in, looked for inside fusions too (GPU fuses the compare)."""
    if instr.opcode == "and":
      return [t for o in instr.operands if o in self.by_name[comp]
              for t in self._terms(comp, self.by_name[comp][o])]
    if instr.opcode == "fusion":
      (inner,) = _called(instr.attrs, "calls")
      return self._terms(inner, next(i for i in self.comps[inner] if i.root))
    return [(comp, instr)]

  def _unfused(self, comp: str, name: str) -> _Instr | None:
    """Value `name` of `comp` seen from outside any fusion: a fused
    computation's parameter k is its fusion's operand k."""
    instr = self.by_name[comp].get(name)
    while instr is not None and instr.opcode == "parameter" and (
        comp in self.fused_by):
      comp, fusion = self.fused_by[comp]
      instr = self.by_name[comp].get(fusion.operands[int(instr.args)])
    return instr

  def trips(self, comp: str, instr: _Instr) -> int | None:
    """A `while`'s trip count, or its bound: a condition `i < c` (alone,
    or and-ed with others: a draft loop that may stop early runs at most
    that often; fused or not) on a tuple element whose initial value is a
    constant."""
    (cond,) = _called(instr.attrs, "condition")
    root = next(i for i in self.comps[cond] if i.root)
    for where, compare in self._terms(cond, root):
      if compare.opcode != "compare" or "direction=LT" not in compare.attrs:
        continue
      lhs, rhs = (self._unfused(where, o) for o in compare.operands)
      limit = _constant(rhs)
      if lhs is None or lhs.opcode != "get-tuple-element" or limit is None:
        continue
      element = int(re.search(r"index=(\d+)", lhs.attrs).group(1))
      init = self.by_name[comp].get(instr.operands[0])
      if init is None or init.opcode != "tuple":
        continue
      start = self.by_name[comp].get(init.operands[element])
      while start is not None and start.opcode == "copy":
        start = self.by_name[comp].get(start.operands[0])
      start = _constant(start)
      if start is not None:
        return max(limit - start, 0)
    return None

  def moves(self, instr: _Instr, names: dict[str, _Instr]
            ) -> tuple[float, float]:
    """(HBM bytes read, HBM bytes written) of one top-level instruction."""
    op = instr.opcode
    operands = [names[o] for o in instr.operands if o in names]
    if op in ("fusion", "fusion-start"):
      (inner,) = _called(instr.attrs, "calls")
      read = sum(self.param_read(inner, k, _bytes(o.type))
                 for k, o in enumerate(operands) if _bytes(o.type))
      return read, self.written(inner)
    if op == "copy-start":  # (destination, source, context)
      return _bytes(operands[0].type), _bytes(
          _ARRAY.search(instr.type).group(0))
    if op == "slice-start":  # ((source), destination, context)
      dest = "{}[{}]{}".format(*_ARRAY.findall(instr.type)[1])
      return _bytes(dest, hbm_only=False), _bytes(dest)
    if op.endswith("-start") and instr.type.startswith("(("):
      # An asynchronous operation: ((operands), results, context...); a
      # slice reads from HBM what it writes, wherever it writes it.
      results = _split_tuple(instr.type)[1]
      if op.removesuffix("-start") in _SLICES:
        return _bytes(results, hbm_only=False), _bytes(results)
      return sum(_bytes(o.type) for o in operands), _bytes(results)
    if op in _SLICES:
      return _bytes(instr.type), _bytes(instr.type)
    if op == "dynamic-update-slice":
      update = _bytes(operands[1].type) if _bytes(instr.type) else 0.0
      return update, update
    read = sum(_bytes(o.type) for o in operands)
    if op == "custom-call" and _WORKSPACE.search(instr.attrs):
      # (results..., s8[n] workspace): scratch, not a result written.
      *results, _ = _split_tuple(instr.type)
      return read, sum(_bytes(t) for t in results)
    return read, _bytes(instr.type)

  def walk(self, comp: str) -> tuple[float, float, float, float, list]:
    """(HBM bytes read, written, collectives, FLOPs, kernels) of one run
    of `comp`; kernels: [(runs per run of `comp`, bytes, FLOPs)]."""
    read = written = coll = flops = 0.0
    kernels = []
    names = self.by_name[comp]

    def add(cost, n=1):
      nonlocal read, written, coll, flops
      r, w, c, f, k = cost
      read, written, coll, flops = (read + n * r, written + n * w,
                                    coll + n * c, flops + n * f)
      kernels.extend((n * runs, b, fl) for runs, b, fl in k)

    for instr in self.comps[comp]:
      op = instr.opcode
      if op in _FREE or op.endswith("-done"):  # a start moved the bytes
        continue
      if op == "while":
        (body,) = _called(instr.attrs, "body")
        n = self.trips(comp, instr)
        if n is None:
          self.unknown_trips += 1
          n = 1
        self.scale *= n
        cost = self.walk(body)
        self.scale /= n
        add(cost, n)
        continue
      if op in ("conditional", "call", "async-start"):
        callees = (_called(instr.attrs, "branch_computations")
                   or _called(instr.attrs, "true_computation")
                   + _called(instr.attrs, "false_computation")
                   if op == "conditional" else
                   _called(instr.attrs, "to_apply")
                   + _called(instr.attrs, "calls"))
        costs = [self.walk(c) for c in callees]
        if op == "conditional" and costs:  # the dearest branch
          where = re.search(r'op_name="([^"]*)"', instr.attrs)
          cheap = where and set(where.group(1).split("/")) & self.cheapest
          costs = [(min if cheap else max)(costs,
                                           key=lambda x: x[0] + x[1])]
        for cost in costs:
          add(cost)
        continue
      c = float(any(op.startswith(c) for c in _COLLECTIVES) or (
          _GPU_COLLECTIVE in instr.attrs))
      r, w = self.moves(instr, names)
      f = (sum(map(self.fused_flops, _called(instr.attrs, "calls")))
           if op in ("fusion", "fusion-start") else
           _product_flops(instr, names) if op in ("dot", "convolution")
           else 0.0)
      if comp == self.entry and op == "copy" and (
          names[instr.operands[0]].opcode == "parameter"):
        # An argument relaid out for its readers: compiled alone, a step
        # copies its weights so; the whole generation (8B int8, B = 64)
        # fused the relayout into the products instead.
        self.argument_copies += r + w
        add((r, w, c, f, []))
      else:
        add((r, w, c, f, [(1.0, r + w, f)] if r + w or f else []))
      where = re.search(r'op_name="([^"]*)"', instr.attrs)
      key = (op, where.group(1) if where else "")
      self.moved[key] = self.moved.get(key, 0.0) + self.scale * (r + w)
    return read, written, coll, flops, kernels


def _constant(instr: _Instr | None) -> int | None:
  """The value of an integer scalar `constant`, else None."""
  if instr is None or instr.opcode != "constant":
    return None
  try:
    return int(instr.args)
  except ValueError:
    return None


def count(text: str, cheapest: tuple[str, ...] = ()) -> HloCount:
  """Counts one run of the optimised HLO module `text`
  (`compiled.as_text()`): each `conditional` at its dearest branch, but
  at its cheapest under a name scope in `cheapest` (a greedy run's
  `sampling.SCOPE`: greedy is the cheap branch)."""
  counter = _Counter(text, cheapest)
  read, written, coll, flops, kernels = counter.walk(counter.entry)
  instrs = [i for c in counter.comps.values() for i in c]
  return HloCount(
      hbm_bytes=read + written, hbm_written=written, collectives=coll,
      instructions=len(instrs),
      fusions=sum(i.opcode == "fusion" for i in instrs),
      while_loops=sum(i.opcode == "while" for i in instrs),
      unknown_trips=counter.unknown_trips,
      largest=tuple(sorted(((b, op, where) for (op, where), b
                            in counter.moved.items()), reverse=True)[:12]),
      flops=flops, kernels=tuple(kernels),
      argument_copies=counter.argument_copies)
