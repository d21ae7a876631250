#include "shim.h"

uint32_t dfi_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
struct fi_info *dfi_allocinfo(void) { return fi_allocinfo(); }
int dfi_close(struct fid *f) { return fi_close(f); }
int dfi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context)
{ return fi_domain(fabric, info, domain, context); }
int dfi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context)
{ return fi_endpoint(domain, info, ep, context); }
int dfi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context)
{ return fi_av_open(domain, attr, av, context); }
int dfi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context)
{ return fi_cq_open(domain, attr, cq, context); }
int dfi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int dfi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int dfi_getname(fid_t fid, void *addr, size_t *addrlen) { return fi_getname(fid, addr, addrlen); }
int dfi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags, void *context)
{ return fi_av_insert(av, addr, count, fi_addr, flags, context); }
int dfi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
               uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context)
{ return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context); }
void *dfi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t dfi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
int dfi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags) { return fi_mr_bind(mr, bfid, flags); }
int dfi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
ssize_t dfi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr,
                  uint64_t addr, uint64_t key, void *context)
{ return fi_write(ep, buf, len, desc, dest_addr, addr, key, context); }
ssize_t dfi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                      fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context)
{ return fi_writedata(ep, buf, len, desc, data, dest_addr, addr, key, context); }
ssize_t dfi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr,
                 uint64_t addr, uint64_t key, void *context)
{ return fi_read(ep, buf, len, desc, src_addr, addr, key, context); }
ssize_t dfi_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t dfi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags)
{ return fi_cq_readerr(cq, buf, flags); }
const char *dfi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len)
{ return fi_cq_strerror(cq, prov_errno, err_data, buf, len); }
