// What the static CUDA runtime (libcudart_static.a) and csrc/cuda/stream.cpp would take from glibc 2.34,
// where glibc moved libdl, libpthread and librt into libc with new versions (glibc_pin.h). On glibc < 2.34
// the old versions live in libdl.so.2, libpthread.so.0 and librt.so.1, which setup.py therefore names as
// NEEDED. The list is what `objdump -T` showed above GLIBC_2.28 in a CUDA 13.0 _C linked without it;
// scripts/check_glibc_versions.py fails the wheel build if one is missing.
#include "glibc_pin.h"

GRADACC_PIN_GLIBC(dlclose, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(dlerror, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(dlmopen, "GLIBC_2.3.4");
GRADACC_PIN_GLIBC(dlopen, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(dlsym, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(dlvsym, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_condattr_setpshared, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_create, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_detach, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_getspecific, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_join, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_key_create, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_key_delete, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_kill, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_mutex_trylock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_mutexattr_destroy, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_mutexattr_init, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_mutexattr_setpshared, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_mutexattr_settype, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_once, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_destroy, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_init, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_rdlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_timedrdlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_timedwrlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_tryrdlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_trywrlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_unlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlock_wrlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlockattr_destroy, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlockattr_init, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_rwlockattr_setpshared, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_setspecific, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_spin_destroy, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_spin_init, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_spin_lock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_spin_trylock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(pthread_spin_unlock, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(sem_destroy, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(sem_init, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(sem_post, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(sem_timedwait, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(sem_trywait, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(sem_wait, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(shm_open, "GLIBC_2.2.5");
GRADACC_PIN_GLIBC(shm_unlink, "GLIBC_2.2.5");
