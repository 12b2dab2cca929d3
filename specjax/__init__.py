"""specjax: speculative decoding for Flax language models in JAX.

Import the modules you use (`from specjax import decode, registry`); this
package imports nothing itself, so setup.cfg can read `__version__`.
"""

__version__ = "0.2.0"
