"""The Vulkan backend on the `vulkan` package (cffi over the system loader, libvulkan.so.1): every physical device
with a compute queue is a `vulkan:N` device. Each kernel is one GLSL compute shader (its KernelStep's `src`),
compiled by `glslc` to SPIR-V (cached on disk), validated by `spirv-val`, and loaded as one compute pipeline.

Shader interface (the renderer's contract, cfamily's `glsl_interface`): a shader reads its buffers by device address
(`GL_EXT_buffer_reference`, Vulkan 1.2's bufferDeviceAddress), so neither the number of buffers nor a binding's range
(`maxStorageBufferRange`: 128 MiB on lavapipe) limits a kernel. Its one binding (set 0, binding 0, a dynamic storage
buffer) holds its words: the buffers' addresses in order, then the scalar arguments, a 64-bit word each (two uint32s,
low first). A launch dispatches `Launch.grid` work groups; the shader declares its own local size.

Command buffers: a plan's batch of kernels on this device (`BatchState`) is recorded once into a command buffer
with a barrier after each dispatch, and submitted again on the plan's later runs: a run only writes its buffers'
addresses and scalars into the command buffer's words (a few are kept per batch, so that runs in flight overlap).
Other work (a lone launch, copies) records a one-time command buffer. Recording, host copies into mapped memory and
vkQueueSubmit all happen on the device's submit thread (`queues.QueuedDevice`, as OpenCL's and wgpu's): the caller (the
event loop, for the executor's calls) only numbers the work and hands it over.

Memory: pooled VkBuffers, each with its own VkDeviceMemory. Where the device's memory is host memory (a CPU device
such as lavapipe, an integrated GPU) it is mapped once and stays mapped: host reads and writes are memcpys. Elsewhere
it is device-local and host transfers go through a pool of mapped staging buffers, by copy commands on the queue.

Completion: one timeline semaphore per device; every submission signals the next value, which is the value of the
device's TimelineSignal. One waiter thread per device waits on it value by value (`vkWaitSemaphores`; cffi
releases the GIL in C calls), runs a read's host copy, then advances the timeline (`queues.QueuedDevice`).

Waits: on another vulkan device of the same physical device (one VkDevice serves all the `vulkan:N` of one physical
device, see `device_ids`) whose submit thread has submitted the value waited for, the submission waits on that device's
timeline semaphore. On any other device (C, OpenCL, CUDA, a vulkan device of another physical device) the submit
thread waits until that device's timeline reaches the value, then submits: never the event loop.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from azyx import debug
from azyx.allocator import Slabs
from azyx.codegen.dialect import GLSL, glsl_dialect
from azyx.compiler import compiler_says, kernel_list, run_compiler
from azyx.device import BatchState, Buffer, Contexts, Device, LaunchItem, word_table
from azyx.errors import DeviceError
from azyx.memory import Lent
from azyx.plan import KernelStep
from azyx.queues import CommandGathers, run_each
from azyx.workers import at_lower_priority

# device_ids: which physical devices (indices, all when empty; one may repeat); spin_us: as opencl's
CONFIG = {"enabled": True, "device_ids": [], "memory": None, "spin_us": 20, "gather": True}

try:
    import vulkan as vk
except (ImportError, OSError) as e:  # OSError: the package is there, the loader (libvulkan.so.1) is not
    raise ImportError(f"the vulkan package or the Vulkan loader is missing: {e}") from None

ffi = vk.ffi
WAIT_SLICE_NS = 1_000_000_000  # the waiter thread waits on the semaphore in slices of this (so that close stops it)
GLSLC_FLAGS = ["-fshader-stage=compute", "--target-env=vulkan1.2", "-O"]
WORDS_TYPE = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER_DYNAMIC  # a kernel's one binding: its words
SETS_PER_POOL = 64  # descriptor sets per descriptor pool (a command buffer keeps one set for its words)
WORDS_RANGE = 4096  # bytes of words one kernel may read (its buffers' addresses and its scalars: 512 64-bit words)
SLAB, SLAB_PIECE, SLAB_ALIGN = 4 << 20, 256 << 10, 256  # blocks of up to SLAB_PIECE bytes are pieces of slabs
KEPT_PER_BATCH = 4  # command buffers recorded once and re-submitted, per batch of a plan on this device
SHADER_DEVICE_ADDRESS = 0x00020000  # VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT (core in 1.2; the package has the
MEMORY_DEVICE_ADDRESS = 0x00000002  # VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT       extension's names only, as None)
BUFFER_USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
                vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT | SHADER_DEVICE_ADDRESS)
HOST_VISIBLE = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
DEVICE_LOCAL = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
# every command's writes before every later command and the host's reads (the queue is in order; a barrier orders
# all the commands submitted before it, in earlier command buffers too, before all those after it)
BARRIER_SRC, BARRIER_DST = vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, (vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT |
                                                                  vk.VK_PIPELINE_STAGE_HOST_BIT)
ACCESS_DST = vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT | vk.VK_ACCESS_HOST_READ_BIT
PROCESSOR = {vk.VK_PHYSICAL_DEVICE_TYPE_CPU: "CPU", vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: "IntegratedGPU",
             vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: "DiscreteGPU"}  # a device type's name (Device.runs_on)
# features a kernel may need, enabled where the device has them: (struct, field)
OPTIONAL_FEATURES = [("core", "shaderInt64"), ("core", "shaderFloat64"), ("core", "shaderInt16"),
                     ("v11", "storageBuffer16BitAccess"), ("v12", "storageBuffer8BitAccess"), ("v12", "shaderInt8"),
                     ("v12", "shaderFloat16")]


# ------------------------------------------------------------------------------------------------ instance, contexts
@functools.cache
def instance() -> Any:
    """The process's VkInstance (Vulkan 1.2 at least: timeline semaphores are core there)."""
    app = vk.VkApplicationInfo(pApplicationName="azyx", apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
    try:
        inst = at_lower_priority(vk.vkCreateInstance, vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
        at_lower_priority(vk.vkEnumeratePhysicalDevices, inst)  # (a driver's threads start with its devices)
        return inst
    except vk.VkError as e:
        raise DeviceError(f"no Vulkan instance (is a Vulkan driver installed?): {type(e).__name__}") from None


def compute_family(pd: Any) -> int | None:
    """The first queue family of a physical device that runs compute work."""
    for i, q in enumerate(vk.vkGetPhysicalDeviceQueueFamilyProperties(pd)):
        if q.queueFlags & vk.VK_QUEUE_COMPUTE_BIT:
            return i
    return None


def device_list(options: dict[str, Any]) -> list[int]:
    """Indices (into the instance's physical devices) of the configured ones that run compute work (`device_ids`:
    all when none are named; an index may repeat, for several logical devices on one physical device)."""
    try:
        pds = vk.vkEnumeratePhysicalDevices(instance())
    except vk.VkError as e:
        raise DeviceError(f"no Vulkan physical device: {type(e).__name__}") from None
    wanted = options.get("device_ids") or list(range(len(pds)))
    return [i for i in wanted if 0 <= i < len(pds) and compute_family(pds[i]) is not None]


class _Context:
    """One VkDevice and its compute queue, shared by the vulkan devices of one physical device (so that they wait
    on each other's semaphores and copy between each other's buffers). Queue submissions are serialised here."""

    def __init__(self, index: int):
        self.index = index
        self.pd = vk.vkEnumeratePhysicalDevices(instance())[index]
        self.props = vk.vkGetPhysicalDeviceProperties(self.pd)
        self.limits = self.props.limits
        sg = vk.VkPhysicalDeviceSubgroupProperties()
        fc = vk.VkPhysicalDeviceFloatControlsProperties(pNext=sg)
        m3 = vk.VkPhysicalDeviceMaintenance3Properties(pNext=fc)
        vk.vkGetPhysicalDeviceProperties2(self.pd, vk.VkPhysicalDeviceProperties2(pNext=m3))
        self.max_allocation = int(m3.maxMemoryAllocationSize)
        self.preserve_nan = [w for w in (16, 32, 64) if getattr(fc, f"shaderSignedZeroInfNanPreserveFloat{w}")]
        shuffles = sg.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT and \
            sg.supportedOperations & vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT
        self.subgroup = int(sg.subgroupSize) if shuffles else 0  # lanes of a shuffle (0: no shuffles)
        self.gpu = self.props.deviceType != vk.VK_PHYSICAL_DEVICE_TYPE_CPU
        self.family = compute_family(self.pd)
        self.memory = vk.vkGetPhysicalDeviceMemoryProperties(self.pd)
        v11 = vk.VkPhysicalDeviceVulkan11Features()
        v12 = vk.VkPhysicalDeviceVulkan12Features(pNext=v11)
        feats = vk.VkPhysicalDeviceFeatures2(pNext=v12)
        vk.vkGetPhysicalDeviceFeatures2(self.pd, feats)
        for need in ("timelineSemaphore", "bufferDeviceAddress"):
            if not getattr(v12, need):
                raise DeviceError(f"Vulkan device {self.props.deviceName} lacks {need} (a Vulkan 1.2 feature azyx "
                                  "needs)")
        have = {"core": feats.features, "v11": v11, "v12": v12}
        self.features = {name: bool(getattr(have[s], name)) for s, name in OPTIONAL_FEATURES}
        # enable what the device has (a fresh chain: the queried one is the input)
        on = {s: {n: 1 for t, n in OPTIONAL_FEATURES if t == s and self.features[n]} for s in have}
        on12 = vk.VkPhysicalDeviceVulkan12Features(pNext=vk.VkPhysicalDeviceVulkan11Features(**on["v11"]),
                                                   timelineSemaphore=1, bufferDeviceAddress=1, **on["v12"])
        queue = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.family, pQueuePriorities=[1.0])
        try:
            self.device = at_lower_priority(vk.vkCreateDevice, self.pd, vk.VkDeviceCreateInfo(
                pNext=on12, pQueueCreateInfos=[queue], pEnabledFeatures=vk.VkPhysicalDeviceFeatures(**on["core"])),
                None)
        except vk.VkError as e:
            raise DeviceError(f"vkCreateDevice failed on {self.props.deviceName}: {type(e).__name__}") from None
        self.queue = vk.vkGetDeviceQueue(self.device, self.family, 0)
        self.qlock = threading.Lock()

    def submit(self, cb: Any, sems: list[Any], values: list[int], signal: Any, value: int) -> None:
        """One submission: command buffer `cb` (or None) after semaphores `sems` reach `values`, then `signal` set
        to `value`. Built in cffi directly: the package's struct wrappers cost ~50 us a submission, most of a small
        realize's host time."""
        n = len(sems)
        wait_values = ffi.new("uint64_t[]", values) if n else ffi.NULL
        signal_value = ffi.new("uint64_t[1]", [value])
        timeline = ffi.new("VkTimelineSemaphoreSubmitInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO, "waitSemaphoreValueCount": n,
            "pWaitSemaphoreValues": wait_values, "signalSemaphoreValueCount": 1,
            "pSignalSemaphoreValues": signal_value})
        wait_sems = ffi.new("VkSemaphore[]", sems) if n else ffi.NULL
        stages = ffi.new("VkPipelineStageFlags[]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT] * n) if n else ffi.NULL
        cbs = ffi.new("VkCommandBuffer[1]", [cb]) if cb is not None else ffi.NULL
        signals = ffi.new("VkSemaphore[1]", [signal])
        info = ffi.new("VkSubmitInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "pNext": timeline, "waitSemaphoreCount": n,
            "pWaitSemaphores": wait_sems, "pWaitDstStageMask": stages, "commandBufferCount": int(cb is not None),
            "pCommandBuffers": cbs, "signalSemaphoreCount": 1, "pSignalSemaphores": signals})
        with self.qlock:
            result = vk.lib.vkQueueSubmit(self.queue, 1, info, ffi.NULL)
        if result != vk.VK_SUCCESS:
            raise vk.exception_codes.get(result, vk.VkError)()


def _close(ctx: _Context) -> None:
    """The last user of a context is done with it (`_CONTEXTS`): its VkDevice is destroyed."""
    vk.vkDeviceWaitIdle(ctx.device)
    vk.vkDestroyDevice(ctx.device, None)


_CONTEXTS = Contexts(_close)  # physical device index -> its context, while a vulkan device (or a block of one) uses it


@functools.cache
def glslc_version() -> str:
    if shutil.which("glslc") is None:
        raise DeviceError("glslc (GLSL -> SPIR-V) not found on PATH (Debian: apt install glslc)")
    return compiler_says("vulkan", "glslc", "--version")


# ------------------------------------------------------------------------------------------------ memory
class _Block:
    """`size` bytes at `offset` in a VkBuffer: the whole of a buffer bound to its own VkDeviceMemory, or a piece of a
    slab (`memory` None: allocator.Slabs knows its slab). `address` is its device address (what a shader reads it by:
    its Buffer's `ptr`), `array` its mapping (uint8; None unmapped)."""

    __slots__ = ("buffer", "memory", "offset", "size", "address", "array")

    def __init__(self, buffer: Any, memory: Any, size: int, address: int, array: np.ndarray | None, offset: int = 0):
        self.buffer, self.memory, self.size, self.address, self.array, self.offset = (buffer, memory, size, address,
                                                                                      array, offset)

    @staticmethod
    def piece(slab: _Block, at: int, size: int) -> _Block:
        """The piece of `size` bytes at `at` in a slab."""
        return _Block(slab.buffer, None, size, slab.address + at, None if slab.array is None else
                      slab.array[at:at + size], at)


@dataclasses.dataclass(slots=True, eq=False)
class _Commands:
    """A command buffer and the mapped block of its kernels' words, bound by its descriptor set (one dynamic storage
    buffer: each dispatch binds its words' offset). A one-time buffer is recycled once its submission completed; a
    kept one (`key`: see `_Kept`) stays recorded and is submitted again once `pending`, its last submission, is done."""

    cb: Any
    ds: Any
    words: Lent | None = None
    key: tuple[int, ...] | None = None  # kept: the zero-filled buffers it was recorded with
    pending: int = 0


class _Kept:
    """A plan's batch of kernels on one device, recorded once into a few command buffers that are submitted again
    (`BatchState.prepared`): a run writes its buffers' addresses and scalars into the words of one that is not in
    flight. Once the plan is dropped they go back to the device's spare command buffers."""

    __slots__ = ("device", "cmds")

    def __init__(self, device: VulkanDevice):
        self.device = device
        self.cmds: list[_Commands] = []

    def __del__(self) -> None:
        try:
            self.device.orphans.extend(self.cmds)
        except Exception:  # interpreter shutdown
            pass


class VulkanDevice(CommandGathers):
    kind = "vulkan"
    dialect = GLSL  # kernels are complete shaders (Device.source)
    kills_builds = True  # glslc runs as a process, killed at compile_timeout_s
    shaders = True

    @classmethod
    def count(cls, options: dict[str, Any]) -> int:
        """The configured physical devices (`device_ids`) that have a compute queue."""
        return len(device_list(options))

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        glslc_version()  # (raises where glslc is missing: nothing could be compiled)
        self.slabs = Slabs(SLAB, SLAB_ALIGN, SLAB_PIECE)  # per memory type, the slabs its small blocks are carved from
        pd = device_list(options)[index]  # (index < `count`: the registry's)
        self.ctx = _CONTEXTS.take(pd, functools.partial(_Context, pd))
        try:
            self._setup(options)
        except BaseException:
            _CONTEXTS.release(pd)
            raise
        self.queue.start()

    def _setup(self, options: dict[str, Any]) -> None:
        ctx = self.ctx
        self.vkdev = ctx.device
        self.label = ctx.props.deviceName
        self.limits = ctx.limits
        self.max_groups = tuple(self.limits.maxComputeWorkGroupCount)
        # (a shader reads buffers by address: no binding limits a kernel)
        self.mem.max_block, self.mem.max_block_name = ctx.max_allocation, "maxMemoryAllocationSize"
        self.align = max(int(self.limits.minStorageBufferOffsetAlignment), 8)
        self.features = ctx.features
        # a GPU's subgroups of 32 lanes (NVIDIA's) shuffle; lavapipe's (8 lanes of the CPU's vectors) do not pay
        self.dialect = glsl_dialect(tuple(ctx.preserve_nan), ctx.gpu, ctx.subgroup if ctx.gpu and ctx.subgroup == 32
                                   else 0)
        self.tiles = not ctx.gpu  # register tiles for matrix products on a CPU (on a GPU: dialect.gemm)
        dtype = ctx.props.deviceType
        # memory types a storage buffer may take, and which to use for device buffers and for staging
        probe = self._buffer(64)
        bits = vk.vkGetBufferMemoryRequirements(self.vkdev, probe).memoryTypeBits
        vk.vkDestroyBuffer(self.vkdev, probe, None)
        host_memory = dtype in (vk.VK_PHYSICAL_DEVICE_TYPE_CPU, vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU)
        unified = self._memory_type(bits, DEVICE_LOCAL | HOST_VISIBLE)
        self.mapped = host_memory and unified is not None
        device_type = unified if self.mapped else self._memory_type(bits, DEVICE_LOCAL)
        staging_type = (self._memory_type(bits, HOST_VISIBLE | vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT)
                        or self._memory_type(bits, HOST_VISIBLE))
        if device_type is None or staging_type is None:
            raise DeviceError(f"{self.name}: no memory type for storage buffers")
        heap = ctx.memory.memoryHeaps[ctx.memory.memoryTypes[device_type].heapIndex].size
        # blocks are never dropped by the pools (their memory must be destroyed here): the cache limit is the capacity
        self.mem.open_pool(options, heap * 3 // 4, functools.partial(self._create, device_type, self.mapped))
        self.staging = self.mem.staging(functools.partial(self._create, staging_type, True), "staging", view=_mapping)
        self.mem.destroy, self.mem.address = self._destroy, operator.attrgetter("address")
        self.mem.on_empty = functools.partial(_CONTEXTS.release, ctx.index)  # (its use of it ends with its last block)
        self.runs_on(PROCESSOR.get(dtype, ""))
        self.sem = vk.vkCreateSemaphore(self.vkdev, vk.VkSemaphoreCreateInfo(pNext=vk.VkSemaphoreTypeCreateInfo(
            semaphoreType=vk.VK_SEMAPHORE_TYPE_TIMELINE, initialValue=0)), None)  # the timeline: submission v signals v
        self.ending = False  # (close waited for the queued work: the waiter thread fails what has not completed)
        self.cmd_pool = vk.vkCreateCommandPool(self.vkdev, vk.VkCommandPoolCreateInfo(
            queueFamilyIndex=ctx.family, flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.commands: dict[int, _Commands] = {}  # timeline value -> its one-time command buffer, until it completed
        self.spare: collections.deque[_Commands] = collections.deque()  # completed ones, to record anew
        self.orphans: collections.deque[_Commands] = collections.deque()  # kept ones of dropped plans (`_Kept`)
        self.all_commands: list[_Commands] = []
        # (a gather's commands, `gathered`, are each (record, fill, launch items); their posts)
        self.gathered_posts: list[Callable[[], None]] = []
        # every kernel's interface: binding 0 of set 0 is its words (the renderer's contract, codegen glsl_interface)
        words = vk.VkDescriptorSetLayoutBinding(binding=0, descriptorType=WORDS_TYPE, descriptorCount=1,
                                                stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
        self.set_layout = vk.vkCreateDescriptorSetLayout(self.vkdev, vk.VkDescriptorSetLayoutCreateInfo(
            pBindings=[words]), None)
        self.layout = vk.vkCreatePipelineLayout(self.vkdev, vk.VkPipelineLayoutCreateInfo(
            pSetLayouts=[self.set_layout]), None)
        self.set_pools: list[Any] = []  # descriptor pools of the command buffers' sets
        self.sets_left = 0  # in the last pool
        api = ctx.props.apiVersion
        debug.log(debug.DEVICES, f"{self.name}: {self.label} (Vulkan {api >> 22}.{(api >> 12) & 0x3FF}."
                                 f"{api & 0xFFF}, {'mapped' if self.mapped else 'device-local'} memory, "
                                 f"{heap >> 20} MiB; {', '.join(n for n, on in self.features.items() if on)})")

    def _memory_type(self, bits: int, flags: int) -> int | None:
        mem = self.ctx.memory
        for i in range(mem.memoryTypeCount):
            if bits & (1 << i) and mem.memoryTypes[i].propertyFlags & flags == flags:
                return i
        return None

    def _buffer(self, size: int) -> Any:
        return vk.vkCreateBuffer(self.vkdev, vk.VkBufferCreateInfo(
            size=size, usage=BUFFER_USAGE, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)

    # ------------------------------------------------------------------ memory
    def _create(self, type_index: int, mapped: bool, size: int) -> _Block:
        """A new block for a pool of `size` bytes in memory of type `type_index`, mapped if `mapped`: a small one is
        a piece of a slab (a driver's allocations are slow, and few: maxMemoryAllocationCount is 4096 on NVIDIA's)."""
        block = self.slabs.block(type_index, size, functools.partial(self._whole, type_index, mapped), _Block.piece)
        self.mem.count(1)  # (the memory part's last destroyed lets the shared context go)
        return block

    def _whole(self, type_index: int, mapped: bool, size: int) -> _Block:
        """A buffer of `size` bytes bound to memory of its own."""
        buffer = self._buffer(size)
        try:
            req = vk.vkGetBufferMemoryRequirements(self.vkdev, buffer)
            flags = vk.VkMemoryAllocateFlagsInfo(flags=MEMORY_DEVICE_ADDRESS)
            memory = vk.vkAllocateMemory(self.vkdev, vk.VkMemoryAllocateInfo(
                pNext=flags, allocationSize=req.size, memoryTypeIndex=type_index), None)
        except BaseException:  # (a driver's refusal: the pool's AllocationError)
            vk.vkDestroyBuffer(self.vkdev, buffer, None)
            raise
        vk.vkBindBufferMemory(self.vkdev, buffer, memory, 0)
        info = ffi.new("VkBufferDeviceAddressInfo*", {"sType": vk.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO,
                                                      "buffer": buffer})
        address = vk.lib.vkGetBufferDeviceAddress(self.vkdev, info)  # (the package's wrapper drops the result)
        array = np.frombuffer(vk.vkMapMemory(self.vkdev, memory, 0, size, 0), np.uint8) if mapped else None
        return _Block(buffer, memory, size, int(address), array)

    def _destroy(self, block: _Block) -> None:
        """(Once the device has closed: the memory part's `destroy`.) A slab goes with its last piece."""
        self.slabs.destroy(block, self._free)

    def _free(self, block: _Block) -> None:
        vk.vkDestroyBuffer(self.vkdev, block.buffer, None)
        vk.vkFreeMemory(self.vkdev, block.memory, None)  # (unmaps it)

    def identity(self) -> dict[str, Any]:
        props = self.ctx.props
        return {**super().identity(), "device": str(props.deviceName), "driver": int(props.driverVersion),
                "api": int(props.apiVersion), "vendor_id": int(props.vendorID), "device_id": int(props.deviceID),
                "glsl": self.dialect.name if self.dialect is not None else ""}

    # ------------------------------------------------------------------ compile
    def build(self, src: str, steps: list[KernelStep]) -> dict[str, Any]:
        """Per kernel its SPIR-V (glslc, cached on disk, validated by spirv-val) and a compute pipeline; glslc runs
        in a process group of its own, killed at compile_timeout_s (for all the kernels together)."""
        names = [s.name for s in steps]
        return self.builder.each(steps, lambda step, left: self._pipeline(self._spirv(step, names, left)),
                                 "creating the pipeline", (vk.VkError,))

    def _spirv(self, step: KernelStep, names: list[str], timeout_s: float) -> bytes:
        def validate(spv: Path) -> None:
            if shutil.which("spirv-val") is not None:
                run_compiler(["spirv-val", "--target-env", "vulkan1.2", str(spv)],
                             f"{self.name}: spirv-val of {kernel_list([step.name])}", timeout_s, step.src)

        return self.builder.artifact("vulkan", step.src, ["glslc", *GLSLC_FLAGS, "{src}", "-o", "{out}"],
                                     (".comp", ".spv"), names, [glslc_version()], validate, timeout_s).read_bytes()

    def _pipeline(self, code: bytes) -> Any:
        """A kernel's compute pipeline (every kernel has the device's one pipeline layout: its words)."""
        dev = self.vkdev
        module = vk.vkCreateShaderModule(dev, vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code), None)
        try:
            stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module,
                                                       pName="main")
            return vk.vkCreateComputePipelines(dev, None, 1, [vk.VkComputePipelineCreateInfo(
                stage=stage, layout=self.layout)], None)[0]
        finally:
            vk.vkDestroyShaderModule(dev, module, None)

    # ------------------------------------------------------------------ submission
    def _commands(self, kept: bool = False) -> _Commands:
        """(The submit thread.) A command buffer to record (a completed one, or a new one with its descriptor set),
        begun; `kept`: to be submitted again (see `_kept`), else submitted once."""
        for _ in range(len(self.orphans)):  # kept ones of dropped plans, once their last submission is done
            cmd = self.orphans.popleft()
            (self.spare if cmd.pending <= self.timeline.value else self.orphans).append(cmd)
        if self.spare:
            cmd = self.spare.popleft()
            cmd.key = None
        else:
            cb = vk.vkAllocateCommandBuffers(self.vkdev, vk.VkCommandBufferAllocateInfo(
                commandPool=self.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
            cmd = _Commands(cb, self._descriptor_set())
            self.all_commands.append(cmd)
        vk.vkBeginCommandBuffer(cmd.cb, vk.VkCommandBufferBeginInfo(
            flags=0 if kept else vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
        return cmd

    def _descriptor_set(self) -> Any:
        """(The submit thread.) A new descriptor set for a command buffer's words (a new pool when the last is used
        up)."""
        if not self.sets_left:
            size = vk.VkDescriptorPoolSize(type=WORDS_TYPE, descriptorCount=SETS_PER_POOL)
            self.set_pools.append(vk.vkCreateDescriptorPool(self.vkdev, vk.VkDescriptorPoolCreateInfo(
                maxSets=SETS_PER_POOL, pPoolSizes=[size]), None))
            self.sets_left = SETS_PER_POOL
        self.sets_left -= 1
        return vk.vkAllocateDescriptorSets(self.vkdev, vk.VkDescriptorSetAllocateInfo(
            descriptorPool=self.set_pools[-1], pSetLayouts=[self.set_layout]))[0]

    def _words(self, cmd: _Commands, items: list[LaunchItem]) -> list[int]:
        """(The submit thread, with `cmd` not in flight.) Each kernel's words (its buffers' addresses, then its scalars)
        into the command buffer's words block (a larger block where it is too small, its descriptor set pointed at
        it); returns their offsets (the dynamic offsets of the dispatches)."""
        rows = [[b.ptr for b in bufs] + list(words) for _, bufs, words in items]
        assert all(8 * len(r) <= WORDS_RANGE for r in rows), f"over {WORDS_RANGE // 8} words: {items[0][0].name}.."
        offsets, table = word_table(rows, [8 * len(r) for r in rows], self.align)
        if cmd.words is None or cmd.words.block.size < table.nbytes + WORDS_RANGE:
            cmd.words = self.staging.lend(table.nbytes + WORDS_RANGE)
            block = cmd.words.block
            info = vk.VkDescriptorBufferInfo(buffer=block.buffer, offset=block.offset, range=WORDS_RANGE)
            vk.vkUpdateDescriptorSets(self.vkdev, 1, [vk.VkWriteDescriptorSet(
                dstSet=cmd.ds, dstBinding=0, descriptorType=WORDS_TYPE, pBufferInfo=[info])], 0, None)
        _mapping(cmd.words.block)[:table.nbytes] = table.view(np.uint8)
        return offsets

    def _record_launches(self, cmd: _Commands, items: list[LaunchItem], offsets: list[int]) -> None:
        """Each kernel's dispatch with its words, a barrier after each."""
        cb = cmd.cb
        for (step, bufs, _), offset in zip(items, offsets):
            if step.launch.zero:
                vk.vkCmdFillBuffer(cb, bufs[0].mem.buffer, bufs[0].mem.offset, step.launch.zero, 0)
                _barrier(cb)
            vk.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.programs[step.name])
            vk.vkCmdBindDescriptorSets(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1, [cmd.ds], 1,
                                       [offset])
            vk.vkCmdDispatch(cb, *step.launch.grid)
            _barrier(cb)

    def _kept(self, batch: BatchState, items: list[LaunchItem]) -> _Commands:
        """(The submit thread.) The batch's command buffer recorded for these zero-filled buffers and not in flight, its
        words written; recorded now where none is (kept, while the batch keeps fewer than KEPT_PER_BATCH)."""
        kept = batch.prepared
        if not isinstance(kept, _Kept):
            kept = batch.prepared = _Kept(self)
        key = tuple(bufs[0].ptr if step.launch.zero else 0 for step, bufs, _ in items)
        for cmd in kept.cmds:
            if cmd.key == key and cmd.pending <= self.timeline.value:
                self._words(cmd, items)
                return cmd
        keep = len(kept.cmds) < KEPT_PER_BATCH
        cmd = self._commands(kept=keep)
        self._record_launches(cmd, items, self._words(cmd, items))
        _barrier(cmd.cb)
        vk.vkEndCommandBuffer(cmd.cb)
        if keep:
            cmd.key = key
            kept.cmds.append(cmd)
        return cmd

    def _submit(self, record: Callable[[_Commands], None] | None, waits: list[tuple[Device, int]], keep: Any,
                post: Callable[[], None] | None = None, fill: Callable[[], None] | None = None,
                batch: tuple[BatchState, list[LaunchItem]] | None = None, items: list[LaunchItem] | None = None
                ) -> int:
        """Queue work after `waits` (on the submit thread: `submit`): the commands `record` records (None: none, the
        submission only orders and signals); returns its timeline value. `fill` (a host copy into memory the work
        reads) runs once `waits` are reached, before the work is submitted; `post` runs on the waiter thread once the
        work completed, before the timeline reaches its value. `batch`: a plan's kernels, submitted by a kept command
        buffer (`_kept`). In an open gather, work that waits for nothing joins it (`items`: its launches, recorded
        with the gather's other launches' words); work that waits comes after the work gathered so far."""
        queue = self.queue
        with queue.lock:
            if self.gathered is not None:
                if not waits:
                    self.gathered.append((record, fill, items))
                    if post is not None:
                        self.gathered_posts.append(post)
                    return queue.reserve(keep, post is not None)  # (the gather's one submission completes it)
                self._flush_gathered()
            return queue.enqueue((record, fill, batch, 0), waits, keep, post)

    def submit(self, run: Any, waits: list[tuple[Device, int]], v: int) -> None:
        """(The submit thread.) Once the waits the host sees are reached (`host_waited`), run the work's `fill`,
        record its command buffer and submit it after the native waits (peers' timeline semaphores); it signals `v` on
        this device's. Work whose wait or recording failed is left out (its failure recorded): the submission still
        signals `v`."""
        native, ok = self.queue.host_waited(waits, v)
        record, fill, batch, first = run if ok else (None, None, None, run[3])
        cmd = None
        try:
            if fill is not None:
                fill()
            if batch is not None:
                cmd = self._kept(*batch)
            elif record is not None:
                cmd = self._commands()
                record(cmd)
                _barrier(cmd.cb)
                vk.vkEndCommandBuffer(cmd.cb)
        except BaseException as e:  # the host copy or the recording failed
            self.record_failure(v, e, first)
            if cmd is not None and cmd.key is None:
                vk.vkResetCommandBuffer(cmd.cb, 0)
                self.spare.append(cmd)
            cmd = None
        sems, values = [s for s, _ in native], [u for _, u in native]
        try:
            self.ctx.submit(None if cmd is None else cmd.cb, sems, values, self.sem, v)
        except vk.VkErrorDeviceLost as e:
            raise self.fail(e) from None
        except vk.VkError as e:  # (out of memory: the work is left out, the value still signalled)
            self.record_failure(v, e, first)
            cmd = None
            self.ctx.submit(None, sems, values, self.sem, v)
        if cmd is not None and cmd.key is None:
            self.commands[v] = cmd
        elif cmd is not None:
            cmd.pending = v

    def native_wait(self, dev: Device, v: int) -> Any:
        """The timeline semaphore (and value) of a vulkan device of this context, once its submit thread submitted
        that value (a wait before the signal's submission, on the context's one queue, could wait for ever)."""
        return (dev.sem, v) if self.peer(dev) and dev.queue.through >= v else None

    # ------------------------------------------------------------------ completion
    def wait_event(self, ev: Any, v: int) -> bool:
        """Wait (GIL released) until the timeline semaphore reaches `v`."""
        info = self._wait_info(v)
        while True:
            try:
                vk.vkWaitSemaphores(self.vkdev, info, WAIT_SLICE_NS)
                return True
            except vk.VkTimeout:
                if self.ending:
                    self.record_failure(v, DeviceError(f"{self.name}: work item {v} never completed before close"))
                    return False
            except vk.VkError as e:  # device lost: its work and everything queued behind it is gone
                return self.lost(v, DeviceError(f"{self.name}: waiting for work item {v} failed: {type(e).__name__}"))

    def _wait_info(self, v: int) -> Any:
        return vk.VkSemaphoreWaitInfo(pSemaphores=[self.sem], pValues=ffi.new("uint64_t[1]", [v]))

    def completed(self, v: int) -> None:
        cmd = self.commands.pop(v, None)
        if cmd is not None:
            self.spare.append(cmd)

    def query(self, v: int) -> Callable[[], bool] | None:
        """The semaphore's counter (`poll` spins at most `spin_cap` on it: lavapipe's kernels run on the cores the loop
        would spin on)."""
        counter, vkdev, sem = vk.vkGetSemaphoreCounterValue, self.vkdev, self.sem
        return lambda: counter(vkdev, sem) >= v

    # ------------------------------------------------------------------ launches
    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]],
                    batch: BatchState | None = None) -> int:
        """The kernels back to back in one command buffer (a barrier after each), one submission; a plan's batch by
        command buffers recorded once (`_kept`)."""
        if batch is None or batch.prepared is None:  # (checked here, where the caller sees it, before recording)
            for step, _, _ in items:
                assert all(g <= m for g, m in zip(step.launch.grid, self.max_groups)), \
                    f"{self.name}: grid {step.launch.grid} of {step.name} exceeds maxComputeWorkGroupCount " \
                    f"{self.max_groups}"
        if batch is not None:
            return self._submit(None, waits, items, batch=(batch, items), items=items)
        return self._submit(lambda cmd: self._record_launches(cmd, items, self._words(cmd, items)), waits, items,
                            items=items)

    # a gather (CommandGathers) is one submission of one command buffer recording the commands it took, in order
    def _flush_gathered(self) -> None:
        """Under the lock: the work gathered so far as one submission (its reserved values first..last): the fills,
        then one command buffer of every command in turn, the posts after it completed."""
        work, posts = self.gathered, self.gathered_posts
        if work:
            self.gathered, self.gathered_posts = [], []
            queue = self.queue
            first = queue.submitted - len(work) + 1
            fills = [fill for _, fill, _ in work if fill is not None]
            queue.enqueue((functools.partial(self._record_gathered, work), functools.partial(run_each, fills) if fills
                           else None, None, first), [], None, functools.partial(run_each, posts) if posts else None,
                          first=first)

    def _record_gathered(self, work: list[tuple[Callable[[_Commands], None] | None, Any, list[LaunchItem] | None]],
                         cmd: _Commands) -> None:
        """(The submit thread.) A gather's commands into one command buffer, in order: each one's launches (their words
        written together) or its copies, a barrier after each."""
        launches = [item for _, _, items in work if items for item in items]
        offsets, at = self._words(cmd, launches) if launches else [], 0
        for record, _, items in work:
            if items:
                self._record_launches(cmd, items, offsets[at:at + len(items)])
                at += len(items)
            elif record is not None:
                record(cmd)
                _barrier(cmd.cb)

    # ------------------------------------------------------------------ copies
    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        return self._submit(lambda cmd: _copy(cmd, src.mem, 0, dst.mem, 0, n), waits, (src, dst))

    def host_staging(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A mapped staging block: `copy_from_host` from it is a copy command in queue order."""
        return self.staging.host(nbytes)

    def _host_side(self, buf: Buffer, offset: int, n: int) -> tuple[np.ndarray, Lent | None]:
        """The host memory a host copy of `n` bytes of `buf` from `offset` goes through: the buffer's own mapping where
        device memory is mapped, else a staging block (returned: a copy command moves its bytes)."""
        if self.mapped:
            return _mapping(buf.mem)[offset:offset + n], None
        return self.staging.host(n)

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        """In queue order: mapped memory is copied out by the waiter thread once the work before completed;
        device-local memory goes through a staging block first (a copy command)."""
        n = out.nbytes
        flat = out.reshape(-1).view(np.uint8)
        src, lent = self._host_side(buf, offset, n)
        record = None if lent is None else (lambda cmd: _copy(cmd, buf.mem, offset, lent.block, 0, n))
        return self._submit(record, waits, (buf, out, lent), lambda: np.copyto(flat, src))

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        """From this device's staging (`host_staging`: `keep` is its block): a copy command. From other host memory:
        a host copy into the mapped buffer (or a staging block, then a copy command), by the submit thread once the
        source is ready. (A host copy into mapped memory waits for `waits`, not for this device's earlier work: `dst`
        is the transfer's own, written once, as the executor's destinations are.)"""
        n = host.nbytes
        if (at := self.staging.at(host, keep)) is not None:  # (`host`: the block's mapping, or a part of it)
            return self._submit(lambda cmd: _copy(cmd, keep.block, at, dst.mem, offset, n), waits, (keep, dst))
        src = host.reshape(-1).view(np.uint8)
        target, lent = self._host_side(dst, offset, n)

        def fill() -> None:
            target[:] = src

        record = None if lent is None else (lambda cmd: _copy(cmd, lent.block, 0, dst.mem, offset, n))
        return self._submit(record, waits, (keep, dst, lent), fill=fill)

    # ------------------------------------------------------------------ close
    def drain(self) -> None:
        try:
            vk.vkWaitSemaphores(self.vkdev, self._wait_info(self.queue.through), 20 * WAIT_SLICE_NS)
        except vk.VkError:  # (VkTimeout too: the waiter thread fails what never completed)
            pass
        self.ending = True

    def let_go(self) -> None:
        """Everything this device made; its buffers still out are destroyed as they come back, and the last one lets
        the context go (`mem.on_empty`)."""
        with self.queue.lock:
            for cmd in self.all_commands:
                cmd.words = None
            self.all_commands, self.commands = [], {}
            self.spare, self.orphans = collections.deque(), collections.deque()
            for destroy, objs in ((vk.vkDestroyDescriptorPool, self.set_pools), (vk.vkDestroyCommandPool,
                                  [self.cmd_pool]), (vk.vkDestroyPipeline, self.programs.values()),
                                  (vk.vkDestroyPipelineLayout, [self.layout]),
                                  (vk.vkDestroyDescriptorSetLayout, [self.set_layout]),
                                  (vk.vkDestroySemaphore, [self.sem])):
                for obj in objs:
                    destroy(self.vkdev, obj, None)
            self.programs = {}
            done = self.queue.take_done()
        del done


def _mapping(block: _Block) -> np.ndarray:
    """A mapped block's memory (uint8)."""
    assert block.array is not None, "an unmapped block"
    return block.array


def _barrier(cb: Any) -> None:
    vk.vkCmdPipelineBarrier(cb, BARRIER_SRC, BARRIER_DST, 0, 1, [vk.VkMemoryBarrier(
        srcAccessMask=vk.VK_ACCESS_MEMORY_WRITE_BIT,
        dstAccessMask=ACCESS_DST)], 0, None, 0, None)


def _copy(cmd: _Commands, src: _Block, src_offset: int, dst: _Block, dst_offset: int, n: int) -> None:
    if n:
        vk.vkCmdCopyBuffer(cmd.cb, src.buffer, dst.buffer, 1, [vk.VkBufferCopy(
            srcOffset=src.offset + src_offset, dstOffset=dst.offset + dst_offset, size=n)])
