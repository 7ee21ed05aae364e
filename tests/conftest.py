"""Every test sees 32 simulated CPU devices (a v4-64-sized mesh), set before JAX touches a device."""
import os
import sys

import jax

jax.config.update('jax_num_cpu_devices', 32)
jax.config.update('jax_platforms', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
