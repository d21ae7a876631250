/* Exported wrappers for libfabric's static-inline calls (Rust cannot call
 * those directly). Each forwards its arguments unchanged. */
#ifndef DYNAMO_FABRIC_SHIM_H
#define DYNAMO_FABRIC_SHIM_H
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>

uint32_t dfi_version(void);
struct fi_info *dfi_allocinfo(void);
int dfi_close(struct fid *f);
int dfi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int dfi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int dfi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int dfi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int dfi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int dfi_enable(struct fid_ep *ep);
int dfi_getname(fid_t fid, void *addr, size_t *addrlen);
int dfi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags, void *context);
int dfi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
               uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
void *dfi_mr_desc(struct fid_mr *mr);
uint64_t dfi_mr_key(struct fid_mr *mr);
int dfi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int dfi_mr_enable(struct fid_mr *mr);
ssize_t dfi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr,
                  uint64_t addr, uint64_t key, void *context);
ssize_t dfi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                      fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context);
ssize_t dfi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr,
                 uint64_t addr, uint64_t key, void *context);
ssize_t dfi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t dfi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *dfi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);
#endif
