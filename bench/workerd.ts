/**
 * `workerd`: a Worker in workerd (miniflare) on the built bundle, through warm backends: a Pool at
 * module scope (whose connections an earlier request opened are replaced) against a Client made in
 * each request. Requests per second one after another, and round trips to the first row behind the
 * delay relay (100 ms RTT).
 */
import { readdirSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { Miniflare } from 'miniflare'
import { startDelayRelay } from '../test/support/delay-relay'
import { PASSWORD } from '../test/support/stack'
import { median, printGrid, type Section } from './lib'

const root = fileURLToPath(new URL('..', import.meta.url))
const REQUESTS = 200
const ROUNDS = 5

export const workerd: Section = {
  name: 'workerd',
  async run(ctx) {
    const relay = await startDelayRelay({ host: '127.0.0.1', port: ctx.proxy.port }, 50)
    const chunks = readdirSync(`${root}dist/chunks`).filter((f) => f.endsWith('.mjs'))
    const worker = (proxyPort: number) =>
      new Miniflare({
        modulesRoot: root,
        modules: [
          { type: 'ESModule', path: `${root}bench/workerd-worker.mjs` },
          { type: 'ESModule', path: `${root}dist/index.mjs` },
          ...chunks.map((f) => ({ type: 'ESModule' as const, path: `${root}dist/chunks/${f}` })),
        ],
        compatibilityDate: '2026-04-01',
        bindings: { PROXY: `ws://127.0.0.1:${proxyPort}/v2`, DATABASE_URL: `postgres://scram_user:${encodeURIComponent(PASSWORD)}@${ctx.pg.host}:${ctx.pg.port}/${ctx.pg.database}` },
      })
    const direct = worker(ctx.proxy.port)
    const delayed = worker(relay.port)
    const call = async (mf: Miniflare, mode: string) => {
      const res = await mf.dispatchFetch(`http://w/?mode=${mode}`)
      if (res.status !== 200) throw new Error(`bench workerd: ${mode} answered ${res.status}: ${await res.text()}`)
      await res.arrayBuffer()
    }
    const result: Record<string, { rate: number; trips: number }> = {}
    try {
      await Promise.all([direct.ready, delayed.ready])
      for (const mode of ['module', 'request']) {
        for (let i = 0; i < 20; i++) await call(direct, mode) // warm up, and warm backends
        const start = performance.now()
        for (let i = 0; i < REQUESTS; i++) await call(direct, mode)
        const rate = REQUESTS / ((performance.now() - start) / 1000)
        const trips: number[] = []
        await call(delayed, mode)
        for (let i = 0; i < ROUNDS; i++) {
          const t = performance.now()
          await call(delayed, mode)
          trips.push((performance.now() - t) / relay.rttMs)
        }
        result[mode] = { rate, trips: median(trips) }
      }
    } finally {
      await direct.dispose()
      await delayed.dispose()
      await relay.close()
    }
    printGrid('workerd: module-scope Pool vs a Client per request (warm backends)', ['metric', 'module-scope Pool', 'Client per request', 'ratio'], [
      ['requests/s, one after another', result.module.rate.toFixed(0), result.request.rate.toFixed(0), `${(result.module.rate / result.request.rate).toFixed(2)}x`],
      [`round trips to the first row at 100 ms RTT (median of ${ROUNDS})`, result.module.trips.toFixed(2), result.request.trips.toFixed(2), ''],
    ], ['Each request on the module-scope Pool finds its connection from the request before and replaces it: the same cost as a new Client, no more.'])
    return []
  },
}
