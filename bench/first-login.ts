/**
 * Section "first-login": with --workers 2 in transaction mode, a key's logins after its first, each
 * timed from connect to a query's answer. Those that land on the worker that had not seen the key
 * yet (a backend of the key at Postgres not seen before) against warm ones (a backend already seen).
 * Target: the first on a new worker within 2x of a warm one.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { startChildProxy } from '../test/support/child-proxy'
import { PASSWORD } from '../test/support/stack'
import { ms, percentile, printTable, type Section } from './lib'

const KEYS = 12
const LOGINS = 10

export const firstLogin: Section = {
  name: 'first-login',
  async run(ctx) {
    const { host, port, database } = ctx.pg
    const p = await startChildProxy(`${host}:${port}`, { built: true, env: { EDGEPG_WORKERS: '2' }, flags: ['--pool-mode', 'transaction', '--shutdown-grace', '0'] })
    const newWorker: number[] = []
    const warm: number[] = []
    try {
      await sleep(1000) // (both workers up)
      for (let key = 0; key < KEYS; key++) {
        const seen = new Set<number>()
        for (let i = 0; i < LOGINS; i++) {
          const c = new Client({ host, port, database, user: 'scram_user', password: PASSWORD, application_name: `bench-first-${key}`, webSocketConstructor: WebSocket as any, wsProxy: () => p.url } as any)
          const t0 = performance.now()
          await c.connect()
          const { pid } = (await c.query('SELECT pg_backend_pid() AS pid')).rows[0]
          const took = performance.now() - t0
          await c.end()
          // (The key's very first login reaches Postgres wherever it lands: not counted.)
          if (i > 0) (seen.has(pid) ? warm : newWorker).push(took)
          seen.add(pid)
          await sleep(20)
        }
      }
    } finally {
      await p.stop()
    }
    const [first, usual] = [percentile(newWorker, 50), percentile(warm, 50)]
    const rows = [{ metric: `a key's first login on a worker that had not seen it, p50 (${newWorker.length} of ${KEYS} keys)`, edgepg: ms(first), baseline: ms(usual), ratio: first / usual, target: 2 }]
    printTable(`A key's first login on a new worker (--workers 2, transaction pooling; ${KEYS} keys, ${LOGINS} logins each)`, rows, `warm (${warm.length})`)
    return rows
  },
}
