"""Every test sees 32 simulated CPU devices (a v4-64-sized mesh), set before JAX touches a device."""
import os
import sys
import tempfile

import jax

jax.config.update('jax_num_cpu_devices', 32)
jax.config.update('jax_platforms', 'cpu')
# Many tests compile the same tiny step; a per-session persistent cache compiles each program once.
jax.config.update('jax_compilation_cache_dir', tempfile.mkdtemp(prefix='jax-test-cache-'))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
