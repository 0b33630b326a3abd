#define _GNU_SOURCE
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <sched.h>
static int timeout_ms; static int N=200000;
static int efd[2]; static int ep[2];
static void pin(void){cpu_set_t s;CPU_ZERO(&s);CPU_SET(1,&s);sched_setaffinity(0,sizeof s,&s);}
static void *side(void *arg){ int me=(int)(intptr_t)arg; pin(); struct epoll_event ev; uint64_t v=1;
 for(int i=0;i<N;i++){ if(me==0){ write(efd[1],&v,8);} 
   for(;;){ int n=epoll_wait(ep[me],&ev,1,timeout_ms); if(n==1) break; }
   read(efd[me],&v,8); v=1; if(me==1) write(efd[0],&v,8); }
 return 0;}
int main(int c,char**a){ timeout_ms=atoi(a[1]);
 for(int i=0;i<2;i++){efd[i]=eventfd(0,EFD_NONBLOCK); ep[i]=epoll_create1(0); struct epoll_event ev={.events=EPOLLIN|EPOLLET,.data.u32=i}; epoll_ctl(ep[i],EPOLL_CTL_ADD,efd[i],&ev);}
 struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
 pthread_t th[2]; for(int i=0;i<2;i++) pthread_create(&th[i],0,side,(void*)(intptr_t)i);
 for(int i=0;i<2;i++) pthread_join(th[i],0);
 clock_gettime(CLOCK_MONOTONIC,&t1);
 double ns=(t1.tv_sec-t0.tv_sec)*1e9+(t1.tv_nsec-t0.tv_nsec);
 printf("timeout %d: %.0f ns per round trip (2 sleeps)\n",timeout_ms,ns/N); }
