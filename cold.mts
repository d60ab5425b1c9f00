import { WebSocket } from 'ws'
import { Client } from './src/index'
import { startChildProxy } from './test/support/child-proxy'
import { PASSWORD } from './test/support/stack'
const PG = JSON.parse((await import('node:fs')).readFileSync('/tmp/devpg.out', 'utf8'))
const proxy = await startChildProxy(`${PG.host}:${PG.port}`, { built: true, flags: ['--max-sessions-per-ip', '100000'], nodeArgs: process.env.PROF ? ['--cpu-prof', '--cpu-prof-dir=/tmp/profc'] : [] })
const N = Number(process.env.N ?? 1000)
const one = async () => {
  const c = new Client({ host: PG.host, port: PG.port, database: PG.database, user: 'scram_user', password: PASSWORD, webSocketConstructor: WebSocket as any, wsProxy: () => proxy.url })
  await c.connect(); await c.query('SELECT 1'); await c.end()
}
for (let i = 0; i < 100; i++) await one()
const cpu0 = proxy.cpuSeconds(), me0 = process.cpuUsage(), t0 = performance.now()
for (let i = 0; i < N; i++) await one()
const s = (performance.now() - t0) / 1000, me = process.cpuUsage(me0)
console.log('sessions/s', (N / s).toFixed(0), 'proxy cpu µs/session', ((proxy.cpuSeconds() - cpu0) * 1e6 / N).toFixed(0), 'client cpu µs/session', ((me.user + me.system) / N).toFixed(0))
await proxy.stop()
