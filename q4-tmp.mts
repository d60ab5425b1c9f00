import { startProxy, edgeConfig } from '/work/main/test/support/helpers'
import { WebSocket } from 'ws'
const proxy = await startProxy({ pool: { mode: 'transaction', size: 2, timeoutMs: 2000 } })
const edgepg: any = await import('edgepg' as string)
const a = new edgepg.Client({ ...edgeConfig(proxy.port), webSocketConstructor: WebSocket, application_name: 'q4a' })
const b = new edgepg.Client({ ...edgeConfig(proxy.port), webSocketConstructor: WebSocket, application_name: 'q4b' })
await Promise.all([a.connect(), b.connect()])
const t = Date.now()
console.log((await b.query('SELECT 1 AS x')).rows, Date.now() - t)
await a.end(); await b.end(); await proxy.close()
