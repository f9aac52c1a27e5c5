"""The private torch APIs dynamo-ext uses that the last verified release has (generated: do not edit).

Written by ``scripts/support_table.py write`` from its scan of ``dynamo_ext/`` and
``docs/support/api_presence/2.15.0.json``; ``tests/test_support_table.py`` checks it is current.
One entry per module the code imports: ``module: name ...`` (indented lines continue it), a name being an
attribute chain from the module, ``!`` before one the code uses directly (a release without it fails
where it is used).
"""

RELEASE = "2.15.0"
PRIVATE_APIS = """
torch: _C._current_autograd_node !_TorchCompileInductorWrapper !_TorchCompileWrapper !_dynamo.config
    !_dynamo.config.caching_precompile !_dynamo.config.patch _dynamo.config.strict_precompile
    _dynamo.config.track_nodes_for_deduplication _dynamo.config.use_graph_deduplication
    !_dynamo.config.use_lamba_guard_for_object_aliasing !_dynamo.disable !_dynamo.reset !_guards.Source
    _guards.Source.get_value !_guards.TracingContext.try_get !_guards.tracing !_ops.OpOverload
    !_ops.OpOverloadPacket !ops._c10d_functional !ops._c10d_functional.all_gather_into_tensor
    !ops._c10d_functional.all_gather_into_tensor.default !ops._c10d_functional.all_reduce
    !ops._c10d_functional.all_reduce.default !ops._c10d_functional.all_reduce_coalesced
    !ops._c10d_functional.all_to_all_single !ops._c10d_functional.batch_p2p_ops !ops._c10d_functional.broadcast
    !ops._c10d_functional.irecv !ops._c10d_functional.isend !ops._c10d_functional.reduce_scatter_tensor
    !ops._c10d_functional.reduce_scatter_tensor.default !ops._c10d_functional.wait_tensor
    !ops._c10d_functional.wait_tensor.default !ops.aten._assert_async !ops.aten._assert_async.default
    !ops.aten._assert_async.msg ops.aten._fused_rms_norm !ops.aten._fused_rms_norm.default
    !ops.aten._local_scalar_dense.default
torch._C: _set_grad_enabled
torch._C._distributed_c10d: !PrefixStore !TCPStore !_resolve_process_group
torch._C._dynamo.eval_frame: !_debug_get_precompile_entries !_reset_precompile_entries !set_code_exec_strategy
torch._dynamo: !compiled_autograd !compiled_autograd.AutogradCompilerInstance
    !compiled_autograd.AutogradCompilerInstance.__init__ !compiled_autograd.AutogradCompilerInstance.end_capture
    !compiled_autograd._enable compiled_autograd.compiled_autograd_enabled !compiled_autograd.extract_bw_module
    compiled_autograd.in_compiled_autograd_region convert_frame.compile_lock !exc !exc.PackageError !exc.Unsupported
    !exc.raise_observed_exception !exc.unimplemented !external_utils.wrap_inline !guards
    !guards.CheckFunctionManager !guards.GuardBuilder !guards.GuardBuilder.DTENSOR_SPEC_MATCH
    !guards.GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT !guards.GuardBuilder.ID_MATCH guards.extract_opaque_obj
    !guards.get_verbose_code_parts !guards.install_guard !guards.make_dupe_guard
    output_graph.OutputGraph.install_subgraph !pgo pgo.FrameStateSizeEntry !pgo.FrameStateSizeEntry.make_scalar
    !pgo.auto_dynamic !pgo.auto_unset pgo.process_automatic_dynamic !source.AttrSource !source.DictGetItemSource
    !source.GetItemSource !source.GlobalSource !source.GlobalStateSource !source.NNModuleSource
    !source.TypeDictSource !source.TypeMROSource !source.TypeSource !utils.get_fake_value
    variables.BackwardHookVariable !variables.BackwardHookVariable.create !variables.ConstantVariable
    !variables.ConstantVariable.create !variables.ContextWrappingVariable !variables.GetAttrVariable
    !variables.ListVariable !variables.TensorVariable !variables.TupleVariable
    !variables.TupleVariable._nonvar_fields !variables.UnspecializedNNModuleVariable
    !variables.UnspecializedNNModuleVariable.call_function !variables.UserFunctionVariable
    !variables.VariableTracker !variables.VariableTracker.call_method
torch._dynamo.backends.common: !AotAutograd !AotAutograd.__call__ !aot_module_simplified
torch._dynamo.backends.distributed: !SubmodCompiler !propagate_dynamo_source !propagate_metadata
torch._dynamo.code_context: !code_context !code_context.get_context
torch._dynamo.convert_frame: !_compile
torch._dynamo.eval_frame: !DisableContext !OptimizedModule !OptimizedModule._initialize
torch._dynamo.external_utils: call_accumulate_grad
torch._dynamo.graph_deduplication: !apply_graph_deduplication
torch._dynamo.graph_region_tracker: GraphRegionTracker !GraphRegionTracker.get_identical_regions
    GraphRegionTracker.track_node
torch._dynamo.output_graph: !OutputGraph OutputGraph.bypass_package !OutputGraph.call_user_compiler
    !OutputGraph.dedup_pass !SubgraphTracer !SubgraphTracer._create_proxy !get_builtins_dict
torch._dynamo.package: CompilePackage CompilePackage.initialize CompilePackage.uninstall _DynamoCodeCacheEntry
    !load_guards_state
torch._dynamo.precompile_context: PrecompileContext PrecompileContext._backend_artifacts_by_key
torch._dynamo.side_effects: !SideEffects !SideEffects.mutation !SideEffects.store_attr
torch._dynamo.source: !ConstantSource
torch._dynamo.symbolic_convert: !InstructionTranslator !InstructionTranslator.current_tx TensorifyState
    TensorifyState.force_specializations
torch._dynamo.types: !FrameAction !FrameAction.DEFAULT !FrameAction.SKIP !FrameExecStrategy
torch._dynamo.utils: !_disable_saved_tensors_hooks_during_tracing !counters !counters.clear !counters.update
    !to_fake_tensor
torch._dynamo.variables: !builder !builder.SourcelessBuilder !builder.SourcelessBuilder.create
    !builder.VariableBuilder !builder.VariableBuilder._wrap !builder.make_dupe_guard
    !builder.process_automatic_dynamic !builder.wrap_fx_proxy
torch._functorch._aot_autograd.autograd_cache: AOTAutogradCache !AOTAutogradCache._get_tmp_dir
    !AOTAutogradCache._lookup
torch._functorch._aot_autograd.frontend_utils: process_inputs
torch._functorch._aot_autograd.graph_compile: is_opaque_node
torch._functorch._aot_autograd.schemas: ViewAndMutationMeta
torch._functorch.aot_autograd: process_inputs
torch._functorch.autograd_function: AutogradFunctionApply
torch._functorch.config: autograd_cache_allow_custom_autograd_functions !patch
torch._functorch.partitioners: !default_partition !functionalize_rng_ops
torch._guards: CompileContext CompileContext.current_compile_id !detect_fake_mode
torch._higher_order_ops.wrap: _always_prefer_recompute
torch._inductor: comm_analysis comm_analysis.estimate_nccl_collective_runtime_from_fx_node config.patch
torch._inductor.codecache: FxGraphCachePickler !FxGraphCachePickler.reducer_override
torch._inductor.comm_lowering: can_realize_as_comm_buffer realize_as_comm_buffer
torch._inductor.compile_fx: !compile_fx
torch._inductor.config: aten_distributed_optimizations aten_distributed_optimizations.enable_simple_overlap
    !post_grad_custom_post_pass
torch._inductor.custom_graph_pass: !CustomGraphPass !get_hash_for_files
torch._inductor.fx_passes.control_dependencies: preserve_node_ordering
torch._inductor.ir: CommBufferType CommBufferType.SYMM_MEM !ExternKernel.require_contiguous !Loops !Pointwise.create
    !StorageBox !TensorBox !TensorBox.create !_CollectiveKernel !_CollectiveKernel.create_out_of_place
torch._inductor.lowering: !lowerings !register_lowering
torch._inductor.virtualized: !ops !ops.to_dtype
torch._logging: !trace_structured
torch._ops: !HigherOrderOperator
torch._subclasses.fake_tensor: !FakeTensor !FakeTensorMode
torch.amp: _enter_autocast _exit_autocast
torch.distributed: _DEFAULT_FIRST_BUCKET_BYTES _all_gather_base _reduce_scatter_base
    !distributed_c10d._get_default_store
torch.distributed._functional_collectives: AsyncCollectiveTensor !broadcast
torch.distributed._symmetric_memory: _group_name_to_store !_group_name_to_store.pop _is_test_mode _test_mode
    !enable_symm_mem_for_group !get_symm_mem_workspace is_symm_mem_enabled_for_group is_symm_mem_tensor !rendezvous
torch.distributed.device_mesh: !_mesh_resources !_mesh_resources.get_current_mesh
torch.distributed.distributed_c10d: !_WorldMeta _get_default_group _get_group_size_by_name _get_group_tag
    _get_object_coll_device _rank_not_in_group _resolve_group_name_by_ranks_and_tag
torch.distributed.fsdp._fully_shard._fsdp_collectives: _get_gradient_divide_factors
torch.distributed.fsdp._fully_shard._fsdp_common: DDPMeshInfo TrainingState TrainingState.IDLE
torch.distributed.fsdp._fully_shard._fsdp_param_group: FSDPParamGroup !FSDPParamGroup.post_backward
    !FSDPParamGroup.pre_backward
torch.distributed.fsdp._fully_shard._fsdp_state: FSDPState !FSDPState._pre_backward _register_group_forward_hooks
torch.distributed.nn.functional: _all_gather_base
torch.distributed.tensor: !DTensor._op_dispatcher._allow_implicit_replication
torch.distributed.tensor._api: _ToTorchTensor _ToTorchTensor.forward
torch.distributed.tensor._dtensor_spec: !DTensorSpec
torch.distributed.tensor._ops._tensor_ops:
torch.distributed.tensor._utils: assert_no_mixed_partial_types
torch.distributed.tensor.placement_types: !_StridedShard _StridedShard._local_shard_size_and_offset
torch.fx: proxy._COPY_META_FIELDS
torch.fx._lazy_graph_module: _LazyGraphModule
torch.fx.experimental: !_config !_config.patch
torch.fx.graph: _BoxedCodeGen
torch.nn.modules: !module._global_backward_hooks !module._global_backward_pre_hooks
torch.nn.utils: !stateless._reparametrize_module
torch.utils._config_module: !Config !install_config_module
torch.utils._python_dispatch: !TorchDispatchMode !is_traceable_wrapper_subclass
torch.utils._pytree: !tree_flatten !tree_leaves !tree_map !tree_map_only !tree_unflatten
torch.utils._sympy.symbol: !SymT !SymT.FLOAT !symbol_is_type
"""
