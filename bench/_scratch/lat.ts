import pg from 'pg'
import { spawn } from 'node:child_process'
import { WebSocket } from 'ws'
import { startPostgres, PASSWORD, freePort } from '../../test/stack'
import { Client } from '../../src/index'
import { startProxy } from '../proxy'
import { median } from '../lib'

const pgs = await startPostgres()
const child = await startProxy(`127.0.0.1:${pgs.port}`, 'child')
const inproc = await startProxy(`127.0.0.1:${pgs.port}`, 'in-process')
const relayPort = await freePort()
const relay = spawn(process.execPath, ['--import', 'tsx', 'bench/_scratch/relay.ts', String(pgs.port), String(relayPort)], { stdio: ['ignore', 'pipe', 'inherit'] })
await new Promise((r) => relay.stdout!.once('data', r))
const base = { host: '127.0.0.1', port: pgs.port, database: 'postgres', user: 'scram_user', password: PASSWORD }
const clients: Record<string, pg.Client> = {
  pgTcp: new pg.Client(base),
  pgRelayChild: new pg.Client({ ...base, port: relayPort }),
  edgeChild: new Client({ ...base, webSocketConstructor: WebSocket as any, wsProxy: () => child.url }),
  edgeInproc: new Client({ ...base, webSocketConstructor: WebSocket as any, wsProxy: () => inproc.url }),
  edgeChildNoCoalesce: new Client({ ...base, webSocketConstructor: WebSocket as any, wsProxy: () => child.url, coalesceWrites: false }),
}
for (const c of Object.values(clients)) await c.connect()
const res: Record<string, number[]> = {}
for (const k in clients) res[k] = []
const names = Object.keys(clients)
let n = 0
for (let round = 0; round < 20; round++) {
  const order = round % 2 ? [...names].reverse() : names
  for (const k of order) {
    for (let i = 0; i < 100; i++) {
      const t0 = performance.now()
      await clients[k].query('SELECT $1::int AS v', [++n])
      if (round > 0) res[k].push(performance.now() - t0)
    }
  }
}
for (const k of names) console.log(k.padEnd(22), median(res[k]).toFixed(3), 'ms', (median(res[k]) / median(res.pgTcp)).toFixed(2) + 'x')
for (const c of Object.values(clients)) await c.end()
relay.kill(); await child.stop(); await inproc.stop(); await pgs.stop()
