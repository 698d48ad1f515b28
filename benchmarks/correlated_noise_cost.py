import time, numpy as np, tensorflow as tf
from tf_dpadam.privatizer import correlated_noise as cn
from tf_dpadam.training import noise_history as nh
shapes=[(3,3,1,32),(32,),(3,3,32,32),(32,),(3,3,32,64),(64,),(3,3,64,64),(64,),(3,3,64,128),(128,),(1152,128),(128,),(128,10),(10,)]
print(sum(np.prod(s) for s in shapes))
for b in (1,4,8):
    st=cn.BandedToeplitz.bisr(b); h=nh.NoiseHistory()
    @tf.function
    def step(seed):
        z=[tf.random.stateless_normal(s, seed=seed, alg="philox") for s in shapes]
        if b==1: return tf.add_n([tf.reduce_sum(x) for x in z])
        state=h.state(st, shapes)
        w,v,state=cn.correlate(st,z,state); h.assign(state)
        return tf.add_n([tf.reduce_sum(x) for x in w])
    for i in range(5): step(tf.constant([1,i],tf.int64))
    t=time.perf_counter()
    for i in range(200): step(tf.constant([1,i],tf.int64)).numpy()
    print(b,(time.perf_counter()-t)/200*1000,"ms")
