/** `--workers 2` in transaction pooling: which worker a session is on, and sessions placed as a test needs. */
import assert from 'node:assert/strict'
import type { Client } from '../../src/index'

/** The worker a transaction-pooling session is on: the processID it was told carries the worker's index (proxy/ws/signals.ts). */
export const workerOf = (c: Client) => Math.floor(((c as any).processID - 2 ** 30) / 2 ** 24)

/**
 * Sessions from `connect`, opened until `enough(byWorker)` (at most 60: the kernel picks each one's
 * worker). Two at a time: connections one after another tend to wake the same worker, idle in accept.
 */
export async function sessionsByWorker(connect: () => Promise<Client>, enough: (by: Client[][]) => boolean): Promise<Client[][]> {
  const by: Client[][] = [[], []]
  for (let i = 0; i < 60 && !enough(by); i += 2) for (const c of await Promise.all([connect(), connect()])) by[workerOf(c)].push(c)
  assert.ok(enough(by), `sessions by worker: ${by.map((w) => w.length)}`)
  return by
}
