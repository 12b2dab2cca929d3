"""Scaling out: SPMD over a `jax.sharding.Mesh`.

- `make_mesh(data=, model=)`: a 2-D (data x model) mesh on any devices;
- `rules`: the one partition-rule table over parameter paths;
- `shard(model, mesh)` / `placer`: models placed on a mesh (loaders take
  `mesh=` and place tensor by tensor);
- `batch.Placement`: how the decoders pad and split a batch;
- `memory`: bytes per device of weights, caches and activations before
  compiling;
- `distributed`: `jax.distributed` set-up for multi-host runs.

`generate(..., mesh=mesh)` and `speculative_generate(..., mesh=mesh)` run
tensor-parallel over `MODEL` and data-parallel over `DATA`; greedy outputs
equal the one-device run (tests/test_sharding.py, on 8 host devices).
"""

from specjax.sharding.place import global_array
from specjax.sharding.place import host
from specjax.sharding.place import make_mesh
from specjax.sharding.place import mesh_of
from specjax.sharding.place import placer
from specjax.sharding.place import shard
from specjax.sharding.rules import param_specs
from specjax.shapes import DATA
from specjax.shapes import MODEL

__all__ = ["DATA", "MODEL", "global_array", "host", "make_mesh", "mesh_of",
           "param_specs", "placer", "shard"]
