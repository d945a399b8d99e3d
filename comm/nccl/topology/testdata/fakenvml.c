// A fake libnvidia-ml.so for topology's tests: the NVML entry points
// Discover binds, compiled against NVIDIA's own nvml.h (from go-nvml's
// module) so that a struct layout or signature that Discover gets wrong
// disagrees with the real one here too. The machine it reports is set by
// the fake_* functions; every query checks that NVML is initialised.
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "nvml.h"

#define MAXG 8

struct nvmlDevice_st {
	int index;
};

struct link {
	int state;              // nvmlEnableState_t
	char remote[32];        // bus id at the other end; "" fails the query
	int type;               // nvmlIntNvLinkDeviceType_t
};

static struct nvmlDevice_st devs[MAXG];
static int ngpu;
static char names[MAXG][NVML_DEVICE_NAME_V2_BUFFER_SIZE];
static char uuids[MAXG][NVML_DEVICE_UUID_V2_BUFFER_SIZE];
static char buses[MAXG][NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
static struct link links[MAXG][NVML_NVLINK_MAX_LINKS];
static int levels[MAXG][MAXG];
static int inits, shutdowns, live;
static char fail_fn[64];
static nvmlReturn_t fail_ret;
static int fail_gpu;

void fake_reset(int n) {
	memset(names, 0, sizeof names);
	memset(uuids, 0, sizeof uuids);
	memset(buses, 0, sizeof buses);
	memset(links, 0, sizeof links);
	memset(levels, 0, sizeof levels);
	ngpu = n;
	for (int i = 0; i < MAXG; i++) {
		devs[i].index = i;
		for (int j = 0; j < MAXG; j++) {
			levels[i][j] = i == j ? NVML_TOPOLOGY_INTERNAL : NVML_TOPOLOGY_SYSTEM;
		}
	}
	inits = shutdowns = live = 0;
	fail_fn[0] = 0;
	fail_ret = NVML_SUCCESS;
	fail_gpu = -1;
}

void fake_set_gpu(int i, const char *name, const char *uuid, const char *bus) {
	snprintf(names[i], sizeof names[i], "%s", name);
	snprintf(uuids[i], sizeof uuids[i], "%s", uuid);
	snprintf(buses[i], sizeof buses[i], "%s", bus);
}

void fake_set_link(int i, int link, int state, const char *remote, int type) {
	links[i][link].state = state;
	snprintf(links[i][link].remote, sizeof links[i][link].remote, "%s", remote);
	links[i][link].type = type;
}

void fake_set_level(int i, int j, int level) { levels[i][j] = levels[j][i] = level; }

// fake_fail makes the entry point fn return ret, for GPU gpu only (or for
// every call when gpu is -1).
void fake_fail(const char *fn, int ret, int gpu) {
	snprintf(fail_fn, sizeof fail_fn, "%s", fn);
	fail_ret = (nvmlReturn_t)ret;
	fail_gpu = gpu;
}

int fake_inits(void) { return inits; }
int fake_shutdowns(void) { return shutdowns; }

static int failing(const char *fn, int gpu) {
	return strcmp(fn, fail_fn) == 0 && (fail_gpu < 0 || fail_gpu == gpu);
}

// go-nvml's copy of nvml.h wraps the opaque handle in a one-pointer struct
// (nvmlDevice_t.handle), which is passed and returned exactly as NVIDIA's
// bare pointer on amd64 and arm64.
static int bad(nvmlDevice_t d) { return d.handle == NULL || d.handle < devs || d.handle >= devs + ngpu; }

nvmlReturn_t nvmlInit_v2(void) {
	if (failing("nvmlInit_v2", -1)) {
		return fail_ret;
	}
	inits++;
	live++;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
	if (live == 0) {
		return NVML_ERROR_UNINITIALIZED;
	}
	shutdowns++;
	live--;
	return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
	switch (r) {
	case NVML_SUCCESS:
		return "Success";
	case NVML_ERROR_UNINITIALIZED:
		return "Uninitialized";
	case NVML_ERROR_INVALID_ARGUMENT:
		return "Invalid Argument";
	case NVML_ERROR_NOT_SUPPORTED:
		return "Not Supported";
	case NVML_ERROR_DRIVER_NOT_LOADED:
		return "Driver Not Loaded";
	case NVML_ERROR_GPU_IS_LOST:
		return "GPU is lost";
	default:
		return "Unknown Error";
	}
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (failing("nvmlDeviceGetCount_v2", -1)) {
		return fail_ret;
	}
	*n = (unsigned int)ngpu;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (i >= (unsigned int)ngpu || d == NULL) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	if (failing("nvmlDeviceGetHandleByIndex_v2", (int)i)) {
		return fail_ret;
	}
	d->handle = &devs[i];
	return NVML_SUCCESS;
}

static nvmlReturn_t copy(const char *fn, nvmlDevice_t d, char *out, unsigned int n, const char *s) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (bad(d) || out == NULL) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	if (failing(fn, d.handle->index)) {
		return fail_ret;
	}
	if (strlen(s) >= n) {
		return NVML_ERROR_INSUFFICIENT_SIZE;
	}
	strcpy(out, s);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int n) {
	return copy("nvmlDeviceGetName", d, name, n, bad(d) ? "" : names[d.handle->index]);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int n) {
	return copy("nvmlDeviceGetUUID", d, uuid, n, bad(d) ? "" : uuids[d.handle->index]);
}

// pci fills every field of *p, so that a layout read wrongly shows up as a
// wrong bus id.
static void pci(nvmlPciInfo_t *p, const char *bus) {
	unsigned int dom = 0, b = 0, dev = 0;
	sscanf(bus, "%x:%x:%x", &dom, &b, &dev);
	memset(p, 0xff, sizeof *p);
	snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%04X:%02X:%02X.0", dom & 0xffff, b, dev);
	p->domain = dom;
	p->bus = b;
	p->device = dev;
	p->pciDeviceId = 0x233510de;
	p->pciSubSystemId = 0x18fe10de;
	snprintf(p->busId, sizeof p->busId, "%s", bus);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (bad(d) || p == NULL) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	if (failing("nvmlDeviceGetPciInfo_v3", d.handle->index)) {
		return fail_ret;
	}
	pci(p, buses[d.handle->index]);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, nvmlGpuTopologyLevel_t *level) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (bad(a) || bad(b) || level == NULL) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	if (failing("nvmlDeviceGetTopologyCommonAncestor", a.handle->index)) {
		return fail_ret;
	}
	*level = (nvmlGpuTopologyLevel_t)levels[a.handle->index][b.handle->index];
	return NVML_SUCCESS;
}

// A link never set reports NVML_ERROR_NOT_SUPPORTED, as a GPU without
// NVLink does.
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, nvmlEnableState_t *active) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (bad(d) || active == NULL || link >= NVML_NVLINK_MAX_LINKS) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	if (links[d.handle->index][link].remote[0] == 0 && links[d.handle->index][link].state == 0) {
		return NVML_ERROR_NOT_SUPPORTED;
	}
	*active = (nvmlEnableState_t)links[d.handle->index][link].state;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned int link, nvmlPciInfo_t *p) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (bad(d) || p == NULL || link >= NVML_NVLINK_MAX_LINKS) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	if (links[d.handle->index][link].remote[0] == 0) {
		return NVML_ERROR_NOT_SUPPORTED;
	}
	pci(p, links[d.handle->index][link].remote);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t d, unsigned int link, nvmlIntNvLinkDeviceType_t *t) {
	if (!live) {
		return NVML_ERROR_UNINITIALIZED;
	}
	if (bad(d) || t == NULL || link >= NVML_NVLINK_MAX_LINKS) {
		return NVML_ERROR_INVALID_ARGUMENT;
	}
	*t = (nvmlIntNvLinkDeviceType_t)links[d.handle->index][link].type;
	return NVML_SUCCESS;
}

// The layout of nvmlPciInfo_t, for the test to compare with Go's.
int fake_pci_size(void) { return (int)sizeof(nvmlPciInfo_t); }
int fake_pci_busid_offset(void) { return (int)offsetof(nvmlPciInfo_t, busId); }
int fake_max_links(void) { return NVML_NVLINK_MAX_LINKS; }
