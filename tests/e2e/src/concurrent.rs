//! Running a test's futures at once on its current-thread runtime, without a futures crate.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use anyhow::Result;

/// Polls every future until all are done; the outputs in order.
pub async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(v) => *output = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// [`join_all`] of fallible futures: all their outputs, or the first error (in order).
pub async fn all_ok<T, F: Future<Output = Result<T>>>(
    futures: impl IntoIterator<Item = F>,
) -> Result<Vec<T>> {
    join_all(futures).await.into_iter().collect()
}
