# Sourced by the scripts/gpu_*.sh that need the FFI libraries: keeps $KDTREE_JAX_FFI_DIR when both libraries load
# from it (a build carried from the development machine), else builds ffi/ with CMake into /tmp/kd_build and
# points KDTREE_JAX_FFI_DIR there. Needs $OUT (the build log goes there); exits the script if the build fails.
if ! python3 -c "import ctypes, os; d = os.environ.get('KDTREE_JAX_FFI_DIR', '');
[ctypes.CDLL(os.path.join(d, f)) for f in ('libkdtree_jax_cpu.so', 'libkdtree_jax_cuda.so')]" 2>/dev/null; then
  (cmake -S . -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" &&
    cmake --build /tmp/kd_build -j "$(nproc)") > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  export KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi
fi
