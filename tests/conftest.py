"""Every test sees 32 simulated CPU devices (a v4-64-sized mesh), set before JAX touches a device."""
import atexit
import os
import shutil
import sys
import tempfile

# Many tests compile the same tiny step, in this process and in the trainer processes they start (which
# inherit the environment): a per-session persistent cache compiles each program once. An entry torn by
# a trainer killed mid-write is a truncated compressed file: it fails to decompress, which jax reports
# as a warning and answers with a recompile.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:  # the run's first process (xdist workers inherit it)
    os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='jax-test-cache-')
    atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # noqa: E402  (after the environment it reads)

jax.config.update('jax_num_cpu_devices', 32)
jax.config.update('jax_platforms', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
