"""libdtrain.so, shipped with the dtrain module (setup.py puts it here)."""
