// Counts a CUDA program's copies between host and device, to show what a training step moves.
//
// Loaded by the CUDA driver through `CUDA_INJECTION64_PATH=.gpu/libcount_transfers.so`, it subscribes with CUPTI
// to the driver API's host<->device copy calls and, when the program exits, prints to stderr:
//   transfers: htod <calls> calls <bytes> bytes, dtoh <calls> calls <bytes> bytes
// Every copy Candle and this crate make goes through these calls (cudarc uses the driver API). Built by
// `scripts/build-cuda.sh build`; per-step traffic is the difference between two runs that differ only in steps.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned long long htod_calls, htod_bytes, dtoh_calls, dtoh_bytes;

static void CUPTIAPI on_driver_call(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                                    const void *data) {
    (void)userdata;
    (void)domain;
    const CUpti_CallbackData *call = (const CUpti_CallbackData *)data;
    if (call->callbackSite != CUPTI_API_ENTER) return;
    switch (id) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds:
        htod_calls++;
        htod_bytes += ((const cuMemcpyHtoD_v2_params *)call->functionParams)->ByteCount;
        break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz:
        htod_calls++;
        htod_bytes += ((const cuMemcpyHtoDAsync_v2_params *)call->functionParams)->ByteCount;
        break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds:
        dtoh_calls++;
        dtoh_bytes += ((const cuMemcpyDtoH_v2_params *)call->functionParams)->ByteCount;
        break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz:
        dtoh_calls++;
        dtoh_bytes += ((const cuMemcpyDtoHAsync_v2_params *)call->functionParams)->ByteCount;
        break;
    default:
        break;
    }
}

static void report(void) {
    fprintf(stderr, "transfers: htod %llu calls %llu bytes, dtoh %llu calls %llu bytes\n", htod_calls, htod_bytes,
            dtoh_calls, dtoh_bytes);
}

// The driver's entry point for injection libraries.
int InitializeInjection(void) {
    CUpti_SubscriberHandle subscriber;
    if (cuptiSubscribe(&subscriber, on_driver_call, NULL) != CUPTI_SUCCESS ||
        cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API) != CUPTI_SUCCESS) {
        fprintf(stderr, "count_transfers: CUPTI refused the subscription; nothing is counted\n");
        return 0;
    }
    atexit(report);
    return 1;
}
