"""Model code (Llama family), layers, the architecture registry and checkpoint loading (safetensors, GGUF).

Import from the submodules: ``loader`` (load_model, LoadedModel, resolve_dtype), ``registry``
(MODEL_REGISTRY, ModelLoadError), ``default_model`` (default_model_path).
"""
