/*
 * mpipe_ascend.h: the subset of AscendCL and HCCL that mpipe's pipeline runtime uses,
 * written by the mpipe project from the public API reference (not copied from CANN).
 *
 * Sources (Huawei Ascend documentation, hiascend.com, "AscendCL API reference" =
 * appdevgapi/aclcppdevg_03_*, "HCCL API reference" = hcclapiref/hcclcpp_07_*):
 *   - aclError, aclrtStream, aclrtEvent, ACL_SUCCESS and the error numbers: AscendCL
 *     API reference, "Data types" and "Return codes".
 *   - aclrtMalloc/aclrtMemMallocPolicy, aclrtMemcpy/aclrtMemcpyAsync/aclrtMemcpyKind,
 *     aclrtMemset, aclrtMallocHost, aclrtFree(Host): AscendCL API reference, "Memory
 *     management" (aclcppdevg_03_0106 and neighbours; CANN 8.0).
 *   - Devices, streams, events: AscendCL API reference, "Device management", "Stream
 *     management", "Event management".
 *   - HcclResult, HcclDataType, HcclReduceOp, HcclComm, HcclRootInfo
 *     (HCCL_ROOT_INFO_BYTES = 4108), HcclSendRecvType, HcclSendRecvItem: HCCL API
 *     reference, "Data types" (hcclcpp_07_0046 and neighbours, CANN 8.0).
 *   - HcclSend/HcclRecv/HcclBatchSendRecv, collectives, communicator functions: HCCL
 *     API reference, "Point-to-point" and "Collective communication" (hcclcpp_07_0026,
 *     _0030, _0031, _0032).
 *
 * Only the enumerators documented across CANN releases are stated; the RESERVED
 * sentinels that move between releases are left out on purpose.
 *
 * ascend-sys/tests/abi.rs checks every declaration here against the real CANN headers
 * (taken from the public torch-npu wheel): function types, enum values, struct sizes and
 * field offsets. src/bindings.rs is generated from this file (see ascend-sys/README.md).
 */
#ifndef MPIPE_ASCEND_H
#define MPIPE_ASCEND_H

#include <stddef.h>
#include <stdint.h>

/* The ABI check compiles this header a second time inside a C++ namespace; there the
 * functions must not be `extern "C"` or they would clash with the real declarations. */
#if defined(__cplusplus) && !defined(MPIPE_ASCEND_NO_EXTERN_C)
extern "C" {
#endif

/* ---------------------------------------------------------------- AscendCL types */

/* Status code of every AscendCL function; 0 is success. */
typedef int aclError;
/* Opaque handles. */
typedef void *aclrtStream;
typedef void *aclrtEvent;

/* Status codes (AscendCL API reference, return codes; values are part of the ABI). */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_REPEAT_FINALIZE 100037
#define ACL_ERROR_BAD_ALLOC 200000
#define ACL_ERROR_API_NOT_SUPPORT 200001
#define ACL_ERROR_INVALID_DEVICE 200002
#define ACL_ERROR_INVALID_RESOURCE_HANDLE 200005
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_STREAM_CONTEXT 107003
#define ACL_ERROR_RT_INVALID_HANDLE 107017
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_NO_DEVICE 207004
#define ACL_ERROR_RT_INTERNAL_ERROR 507000

/* Device memory allocation policy (aclrtMalloc). */
typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
    ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5,
    ACL_MEM_TYPE_LOW_BAND_WIDTH = 0x0100,
    ACL_MEM_TYPE_HIGH_BAND_WIDTH = 0x1000
} aclrtMemMallocPolicy;

/* Direction of aclrtMemcpy / aclrtMemcpyAsync. */
typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3
} aclrtMemcpyKind;

/* ---------------------------------------------------------------- AscendCL functions */

/* Initialisation; configPath may be NULL. */
aclError aclInit(const char *configPath);
aclError aclFinalize(void);

/* Devices. */
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtResetDevice(int32_t deviceId);
aclError aclrtGetDeviceCount(uint32_t *count);

/* Streams. */
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);

/* Events. */
aclError aclrtCreateEvent(aclrtEvent *event);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtSynchronizeEvent(aclrtEvent event);
aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent);
aclError aclrtDestroyEvent(aclrtEvent event);

/* Memory: sizes and counts in bytes; destMax/maxCount bound the destination. */
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMallocHost(void **hostPtr, size_t size);
aclError aclrtFreeHost(void *hostPtr);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                     aclrtMemcpyKind kind);
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream);
aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count);

/* ---------------------------------------------------------------- HCCL types */

typedef enum {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_MEMORY = 3,
    HCCL_E_INTERNAL = 4,
    HCCL_E_NOT_SUPPORT = 5,
    HCCL_E_NOT_FOUND = 6,
    HCCL_E_UNAVAIL = 7,
    HCCL_E_SYSCALL = 8,
    HCCL_E_TIMEOUT = 9,
    HCCL_E_OPEN_FILE_FAILURE = 10,
    HCCL_E_TCP_CONNECT = 11,
    HCCL_E_ROCE_CONNECT = 12,
    HCCL_E_TCP_TRANSFER = 13,
    HCCL_E_ROCE_TRANSFER = 14,
    HCCL_E_RUNTIME = 15,
    HCCL_E_DRV = 16,
    HCCL_E_PROFILING = 17,
    HCCL_E_CCE = 18,
    HCCL_E_NETWORK = 19,
    HCCL_E_AGAIN = 20,
    HCCL_E_REMOTE = 21
} HcclResult;

/* Opaque communicator handle. */
typedef void *HcclComm;

typedef enum {
    HCCL_REDUCE_SUM = 0,
    HCCL_REDUCE_PROD = 1,
    HCCL_REDUCE_MAX = 2,
    HCCL_REDUCE_MIN = 3
} HcclReduceOp;

typedef enum {
    HCCL_DATA_TYPE_INT8 = 0,
    HCCL_DATA_TYPE_INT16 = 1,
    HCCL_DATA_TYPE_INT32 = 2,
    HCCL_DATA_TYPE_FP16 = 3,
    HCCL_DATA_TYPE_FP32 = 4,
    HCCL_DATA_TYPE_INT64 = 5,
    HCCL_DATA_TYPE_UINT64 = 6,
    HCCL_DATA_TYPE_UINT8 = 7,
    HCCL_DATA_TYPE_UINT16 = 8,
    HCCL_DATA_TYPE_UINT32 = 9,
    HCCL_DATA_TYPE_FP64 = 10,
    HCCL_DATA_TYPE_BFP16 = 11
} HcclDataType;

/* Size of the opaque root info rank 0 creates and every rank passes to
 * HcclCommInitRootInfo. */
#define HCCL_ROOT_INFO_BYTES 4108

typedef struct HcclRootInfoDef {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

typedef enum {
    HCCL_SEND = 0,
    HCCL_RECV = 1
} HcclSendRecvType;

/* One task of HcclBatchSendRecv: 32 bytes on LP64 (4 + pad 4, 8, 8, 4, 4). */
typedef struct HcclSendRecvItemDef {
    HcclSendRecvType sendRecvType;
    void *buf;
    uint64_t count;
    HcclDataType dataType;
    uint32_t remoteRank;
} HcclSendRecvItem;

/* ---------------------------------------------------------------- HCCL functions */

/* Communicator set-up: rank 0 calls HcclGetRootInfo and ships the bytes to the others. */
HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                HcclComm *comm);
HcclResult HcclCommDestroy(HcclComm comm);
HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize);
HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank);

/* Point to point; counts are in elements of dataType. */
HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank,
                    HcclComm comm, aclrtStream stream);
HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank,
                    HcclComm comm, aclrtStream stream);
HcclResult HcclBatchSendRecv(HcclSendRecvItem *sendRecvInfo, uint32_t itemNum, HcclComm comm,
                             aclrtStream stream);

/* Collectives. */
HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root,
                         HcclComm comm, aclrtStream stream);
HcclResult HcclReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                      HcclReduceOp op, uint32_t root, HcclComm comm, aclrtStream stream);
HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                         HcclReduceOp op, HcclComm comm, aclrtStream stream);
HcclResult HcclBarrier(HcclComm comm, aclrtStream stream);

/* Errors. */
HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *asyncError);
const char *HcclGetErrorString(HcclResult code);

#if defined(__cplusplus) && !defined(MPIPE_ASCEND_NO_EXTERN_C)
}
#endif

#endif /* MPIPE_ASCEND_H */
